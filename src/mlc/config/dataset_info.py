"""LLaMA-Factory's `dataset_info.json`: which file a dataset name means, and how its rows are spelled.

An entry is `{"file_name": ..., "formatting": "alpaca"|"sharegpt", "columns": {...}, "tags": {...}}`. `columns`
renames the row keys (alpaca: prompt, query, response, history, system; sharegpt: messages, system, tools) and
`tags` renames a ShareGPT turn's keys and role values (role_tag, content_tag, user_tag, assistant_tag,
observation_tag, function_tag, system_tag; LLaMA-Factory reads them for sharegpt only, and so does mlc).
`ranking: true` with `columns.chosen` / `columns.rejected` describes pairwise rows (stage dpo or rm) and
`columns.kto_tag` labelled rows (stage kto); supervised fine-tuning refuses both. `num_samples` and the multimodal
columns are refused; `file_sha1` and `split` do not change
how a local file reads. `DatasetSchema` holds the names a file's rows use; without an entry they are our own
defaults (LLaMA-Factory's, plus `system` and `tools`, which are read whenever a row has them).

A data file is described by the entry whose `file_name` is that file, in a `dataset_info.json` in the file's folder
or up to two folders above it (LLaMA-Factory's `dataset_dir` layout), so `mlc-cli preprocess data/x.json`,
`data.train: data/x.json` and `dataset: x` read the same rows. Errors are ValueErrors naming the entry and key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INFO_FILE = "dataset_info.json"
FORMATTINGS = ("alpaca", "sharegpt")
# our default column names (LLaMA-Factory's, except that system and tools are read when present without being named)
COLUMN_DEFAULTS: dict[str, str | None] = {
    "prompt": "instruction", "query": "input", "response": "output", "history": None, "system": "system",
    "messages": "conversations", "tools": "tools",
}
TAG_DEFAULTS: dict[str, str] = {
    "role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
    "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system",
}
# the preference stages' columns (pairwise: chosen/rejected; KTO: the row's desirable/undesirable label)
PREFERENCE_COLUMNS: dict[str, str] = {"chosen": "chosen", "rejected": "rejected", "kto_tag": "label"}
# columns of multimodal data, which `mlc-cli train` cannot use
REFUSED_COLUMNS = {"images": "images", "videos": "videos", "audios": "audio"}
REQUIRED_COLUMNS = {"alpaca": ("prompt", "response"), "sharegpt": ("messages",)}


@dataclass(frozen=True)
class DatasetSchema:
    """How one file's rows are spelled. `formatting` is None for a file no dataset_info.json entry describes."""

    columns: dict[str, str | None] = field(default_factory=lambda: dict(COLUMN_DEFAULTS))
    tags: dict[str, str] = field(default_factory=lambda: dict(TAG_DEFAULTS))
    formatting: str | None = None
    source: str = ""  # "data/dataset_info.json entry 'qa'"
    named: tuple[tuple[str, str], ...] = ()  # (column, key) given in the entry's `columns`
    ranking: bool = False  # LLaMA-Factory's `ranking: true`: pairwise chosen/rejected rows
    preference: dict[str, str] = field(default_factory=lambda: dict(PREFERENCE_COLUMNS))

    @property
    def kto(self) -> bool:
        """The entry names a kto_tag column: rows with one reply and a desirable/undesirable label."""
        return any(kind == "kto_tag" for kind, _ in self.named)

    def col(self, name: str) -> str | None:
        return self.columns[name]

    def tag(self, name: str) -> str:
        return self.tags[name]


DEFAULT_SCHEMA = DatasetSchema()


def read_dataset_info(folder: Path) -> dict[str, Any]:
    """The parsed dataset_info.json of `folder`; {} when there is none."""
    path = folder / INFO_FILE
    if not path.is_file():
        return {}
    try:
        info = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not readable JSON ({e}); fix it (LLaMA-Factory's format: "
                         '{"name": {"file_name": "x.json", "formatting": "alpaca"}})') from None
    if not isinstance(info, dict):
        raise ValueError(f"{path} must hold one object of dataset entries, got a {type(info).__name__}")
    return info


def _mapping(entry: dict, key: str, where: str, allowed) -> dict[str, Any]:
    value = entry.get(key) or {}
    if not isinstance(value, dict):
        raise ValueError(f"{where}: {key} must be an object like {{\"{next(iter(allowed))}\": \"...\"}}, "
                         f"got {type(value).__name__}")
    for k, v in value.items():
        if k not in allowed and k not in REFUSED_COLUMNS and k not in PREFERENCE_COLUMNS:
            raise ValueError(f"{where}: {key}.{k} is not a LLaMA-Factory {key} key; use {', '.join(allowed)}")
        if not isinstance(v, str) or not v:
            raise ValueError(f"{where}: {key}.{k} must name a key of the rows (a non-empty string), got {v!r}")
    return value


def schema_from_entry(name: str, entry: Any, info_path: Path) -> DatasetSchema:
    """The row spelling of one dataset_info.json entry; a ValueError names the entry and the key to fix."""
    where = f"{info_path} entry {name!r}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object with a file_name, got {type(entry).__name__}")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in FORMATTINGS:
        raise ValueError(f"{where}: formatting {formatting!r} is not one mlc reads; use alpaca or sharegpt (rows of "
                         "{messages: [{role, content}]} load as they are: remove the entry, or describe them as "
                         "sharegpt with columns.messages and tags)")
    ranking = entry.get("ranking", False)
    if not isinstance(ranking, bool):
        raise ValueError(f"{where}: ranking must be true or false, got {ranking!r}")
    if entry.get("num_samples") is not None:
        raise ValueError(f"{where}: num_samples is not read by mlc; cut the file to the rows to train on and "
                         "remove num_samples")
    columns = _mapping(entry, "columns", where, COLUMN_DEFAULTS)
    tags = _mapping(entry, "tags", where, TAG_DEFAULTS)
    refused = sorted(set(columns) & set(REFUSED_COLUMNS))
    if refused:
        raise ValueError(f"{where}: columns.{refused[0]} is for {REFUSED_COLUMNS[refused[0]]}, which mlc-cli train "
                         "does not use; remove it (text SFT rows need prompt/response or messages)")
    pref = {k: v for k, v in columns.items() if k in PREFERENCE_COLUMNS}
    if ranking and "kto_tag" in pref:
        raise ValueError(f"{where}: ranking: true (pairwise rows) and columns.kto_tag (labelled rows) exclude each "
                         "other; keep ranking for chosen/rejected pairs or kto_tag for KTO rows")
    if not ranking and ({"chosen", "rejected"} & set(pref)):
        raise ValueError(f"{where}: columns.chosen/rejected describe pairwise rows; add ranking: true to the entry")
    return DatasetSchema(
        columns={**COLUMN_DEFAULTS, **{k: v for k, v in columns.items() if k not in PREFERENCE_COLUMNS}},
        tags={**TAG_DEFAULTS, **tags}, formatting=formatting, source=where, named=tuple(columns.items()),
        ranking=ranking, preference={**PREFERENCE_COLUMNS, **pref},
    )


def entry_file(name: str, folder: Path) -> tuple[str, DatasetSchema]:
    """(data file path, row spelling) of dataset `name` in folder/dataset_info.json."""
    info_path = folder / INFO_FILE
    entry = read_dataset_info(folder).get(name)
    if not isinstance(entry, dict) or not entry.get("file_name"):
        raise ValueError(f"dataset: {name!r} is neither a file nor an entry with a file_name in {info_path}; "
                         "give the data file's path (dataset: data/train.jsonl)")
    return str(folder / entry["file_name"]), schema_from_entry(name, entry, info_path)


def schema_for_file(path: str | Path, levels: int = 3) -> DatasetSchema:
    """The spelling of `path`'s rows: from the dataset_info.json entry whose file_name is `path` (in its folder or
    up to `levels - 1` folders above), else our defaults. Entries that disagree about one file are an error."""
    target = Path(path).resolve()
    folder = target.parent
    for _ in range(levels):
        info = read_dataset_info(folder)
        shown = _relative(folder / INFO_FILE)
        found = {name: schema_from_entry(name, entry, shown) for name, entry in info.items()
                 if isinstance(entry, dict) and isinstance(entry.get("file_name"), str)
                 and (folder / entry["file_name"]).resolve() == target}
        spellings = {(s.formatting, tuple(sorted(s.columns.items(), key=str)), tuple(sorted(s.tags.items())))
                     for s in found.values()}
        if len(spellings) > 1:
            raise ValueError(f"{shown}: entries {', '.join(map(repr, found))} all describe {path} with "
                             "different formatting, columns or tags; keep one entry for the file")
        if found:
            return next(iter(found.values()))
        if folder.parent == folder:
            break
        folder = folder.parent
    return DEFAULT_SCHEMA


def _relative(path: Path) -> Path:
    """`path` as the user would write it from the current directory, when it is below it."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path
