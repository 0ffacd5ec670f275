"""JSONL instruction data -> a tokenized Arrow dataset (input_ids, labels, attention_mask) plus stats.json.

The model's chat template renders each conversation; prompt tokens get label -100 unless `train_on_prompt`;
rows longer than `max_seq_len` are truncated (counted), rows are padded to a multiple of `pad_to_multiple_of`,
and with `packing` several rows share one sequence (position ids restart per row, so attention stays inside it).
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from mlc.config.dataset_info import REQUIRED_COLUMNS, DatasetSchema, schema_for_file
from mlc.errors import DataError, InvalidRequestError
from mlc.models.tokenizer import render_chat
from mlc.train.formats import FORMATS, RecordError, record_tools, to_messages

IGNORE_INDEX = -100
STATS_FILE = "stats.json"
# progress(rows read, done, total): done/total are bytes of a JSONL file, or elements of a JSON array file.
Progress = Callable[[int, int, int], None]


@dataclass(frozen=True)
class PreprocessOptions:
    max_seq_len: int = 512
    pad_to_multiple_of: int = 16
    train_on_prompt: bool = False
    packing: bool = False
    format: str = "auto"
    on_error: str = "skip"  # skip: drop the row and report it; fail: stop at the first bad row

    def __post_init__(self):
        if self.max_seq_len % self.pad_to_multiple_of:
            raise DataError(
                f"max_seq_len {self.max_seq_len} is not a multiple of pad_to_multiple_of {self.pad_to_multiple_of}"
            )
        if self.format not in ("auto", *FORMATS):
            raise DataError(f"unknown data format {self.format!r}; use auto, {', '.join(FORMATS)}")
        if self.on_error not in ("skip", "fail"):
            raise DataError(f"on_error must be skip or fail, not {self.on_error!r}")


@dataclass
class PreprocessStats:
    source: str
    rows_read: int = 0
    rows: int = 0  # examples kept (before packing)
    sequences: int = 0  # rows of the dataset written (after packing)
    tokens: int = 0  # real tokens, padding excluded
    trainable_tokens: int = 0
    padded_tokens: int = 0  # tokens including padding
    truncated: int = 0
    blank_lines: int = 0
    max_tokens: int = 0
    formats: dict[str, int] = field(default_factory=dict)
    dropped: list[dict] = field(default_factory=list)  # {"line": n, "reason": "..."} (n: element of a JSON array)
    layout: str = "jsonl"  # jsonl, or json (one JSON array of rows, as LLaMA-Factory's datasets often are)
    dataset_info: str = ""  # the dataset_info.json entry whose columns/tags the rows were read with
    options: dict = field(default_factory=dict)
    model: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, indent=2)


def _tools_in_system(messages: list[dict], tools: list[dict]) -> list[dict]:
    """For a chat template that ignores `tools`: the definitions go at the end of the system prompt instead."""
    text = "You can call these functions:\n" + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _segments(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[tuple[str, bool]]:
    """(text, trainable) pieces that concatenate to the rendered conversation; assistant turns are trainable."""
    if tools and "tools" not in (getattr(tokenizer, "chat_template", None) or ""):
        messages, tools = _tools_in_system(messages, tools), None
    pieces: list[tuple[str, bool]] = []
    done = ""

    def extend(text: str, trainable: bool) -> None:
        nonlocal done
        if not text.startswith(done):
            raise RecordError("the chat template renders earlier turns differently once later turns are added")
        pieces.append((text[len(done):], trainable))
        done = text

    def render(upto: int, add_generation_prompt: bool) -> str:
        try:
            return render_chat(tokenizer, messages[:upto], add_generation_prompt=add_generation_prompt, tools=tools)
        except InvalidRequestError as e:
            raise RecordError(e.message) from None

    for i, message in enumerate(messages):
        if message["role"] == "assistant" and i > 0:
            extend(render(i, True), False)
        extend(render(i + 1, False), message["role"] == "assistant")
    return pieces


def tokenize_messages(tokenizer, messages: list[dict], train_on_prompt: bool = False,
                      tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """input_ids and labels (prompt tokens -100 unless train_on_prompt); the answer ends with EOS. `tools`
    (function definitions) go to the chat template, or into the system prompt when the template has no place."""
    ids: list[int] = []
    labels: list[int] = []
    pieces = _segments(tokenizer, messages, tools)
    last_trainable = max(i for i, (_, t) in enumerate(pieces) if t)
    for i, (text, trainable) in enumerate(pieces):
        piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        # Templates without an end-of-turn token (GLM-4's) would never teach the model to stop.
        if i == last_trainable and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in piece:
            piece = piece + [tokenizer.eos_token_id]
        ids += piece
        labels += piece if (trainable or train_on_prompt) else [IGNORE_INDEX] * len(piece)
    if labels:
        labels[0] = IGNORE_INDEX  # no token predicts the first one
    return ids, labels


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_row(ids: list[int], labels: list[int], multiple: int, pad_id: int) -> dict:
    n = len(ids)
    extra = round_up(n, multiple) - n
    return {
        "input_ids": ids + [pad_id] * extra,
        "labels": labels + [IGNORE_INDEX] * extra,
        "attention_mask": [1] * n + [0] * extra,
    }


def pack_rows(examples: list[tuple[list[int], list[int]]], max_seq_len: int, multiple: int, pad_id: int) -> list[dict]:
    """Greedy in-order packing; each row's position ids start at 0 so transformers masks across rows."""
    packed: list[dict] = []
    cur: dict = {"input_ids": [], "labels": [], "position_ids": []}

    def flush() -> None:
        n = len(cur["input_ids"])
        extra = round_up(n, multiple) - n
        packed.append({
            "input_ids": cur["input_ids"] + [pad_id] * extra,
            "labels": cur["labels"] + [IGNORE_INDEX] * extra,
            "attention_mask": [1] * n + [0] * extra,
            "position_ids": cur["position_ids"] + list(range(extra)),
        })

    for ids, labels in examples:
        if cur["input_ids"] and len(cur["input_ids"]) + len(ids) > max_seq_len:
            flush()
            cur = {"input_ids": [], "labels": [], "position_ids": []}
        cur["input_ids"] += ids
        # a row's first token is never a target on its own (the shift drops it); packed, it would be predicted from
        # the previous row's last token (tokenize_messages masks it already; rows from elsewhere may not)
        cur["labels"] += [IGNORE_INDEX] + labels[1:] if labels else []
        cur["position_ids"] += list(range(len(ids)))
    if cur["input_ids"]:
        flush()
    return packed


def _starts_with_array(path: Path) -> bool:
    with path.open("rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def _read_json_array(path: Path, stats: PreprocessStats, progress: Optional[Progress]):
    """(element number, row) of a file holding one JSON array of rows."""
    try:
        rows = json.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: invalid JSON ({e.msg} at line {e.lineno}, column {e.colno}); a .json file must "
                        "hold one array of rows, a .jsonl file one row per line") from None
    stats.layout = "json"
    for n, row in enumerate(rows, start=1):
        stats.rows_read += 1
        if progress:
            progress(stats.rows_read, n, len(rows))
        yield n, row


def _read_jsonl(path: Path, stats: PreprocessStats, opts: PreprocessOptions, progress: Optional[Progress] = None):
    """(line number, parsed object) for each non-blank line; bad JSON or bad UTF-8 is a dropped row. A file that
    is one JSON array (LLaMA-Factory's .json datasets) gives (element number, row) instead."""
    try:
        if _starts_with_array(path):
            yield from _read_json_array(path, stats, progress)
            return
        handle = path.open("rb")
        total = path.stat().st_size
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None
    done = 0
    with handle:
        for line_no, raw in enumerate(handle, start=1):
            done += len(raw)
            blank = not raw.strip()
            stats.blank_lines += blank
            stats.rows_read += not blank
            if progress:
                progress(stats.rows_read, done, total)
            if blank:
                continue
            try:
                yield line_no, json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                _drop(stats, opts, path, line_no, "not UTF-8 text")
            except json.JSONDecodeError as e:
                _drop(stats, opts, path, line_no, f"invalid JSON ({e.msg} at column {e.colno})")


def read_records(path: str | Path) -> Iterator[object]:
    """The parsed rows of a JSONL or JSON-array data file; unreadable lines are left out (tokenize_file reports
    them)."""
    path = Path(path)
    stats = PreprocessStats(source=str(path))
    for _, record in _read_jsonl(path, stats, PreprocessOptions()):
        yield record


def _drop(stats: PreprocessStats, opts: PreprocessOptions, path: Path, line_no: int, reason: str) -> None:
    if opts.on_error == "fail":
        where = f"{path} row {line_no}" if stats.layout == "json" else f"{path}:{line_no}"
        raise DataError(f"{where}: {reason}; fix the row or pass --on-error skip to drop bad rows")
    stats.dropped.append({"line": line_no, "reason": reason})


def data_schema(path: str | Path, fmt: str = "auto") -> tuple[str, DatasetSchema]:
    """The format to read `path` with and how its rows are spelled: a LLaMA-Factory dataset_info.json entry whose
    file_name is `path` gives its formatting, columns and tags (mlc.config.dataset_info)."""
    try:
        schema = schema_for_file(path)
    except ValueError as e:
        raise DataError(str(e)) from None
    fits = {"alpaca": ("auto", "alpaca", "instruction"), "sharegpt": ("auto", "sharegpt")}
    if schema.formatting and fmt not in fits[schema.formatting]:
        raise DataError(f"format {fmt} was asked for {path}, but {schema.source} says formatting: "
                        f"{schema.formatting}; leave the format at auto (--format / data.format) or fix the entry")
    return fmt, schema


def _check_first_row(schema: DatasetSchema, record: dict, path: Path) -> None:
    """The keys a dataset_info.json entry says every row has, on the first row: a wrong name fails the file at
    once, not every row one by one."""
    assert schema.formatting is not None  # the caller checks: only an entry's schema has a formatting
    named = dict(schema.named)
    for kind in REQUIRED_COLUMNS[schema.formatting]:
        key = schema.col(kind)
        if key not in record:
            how = f"columns.{kind}" if kind in named else f"the default, as the entry gives no columns.{kind}"
            raise DataError(f"{path}: {schema.source} reads {kind} from {key!r} ({how}), but the first row has no "
                            f"{key!r} (its keys: {', '.join(map(str, record)) or 'none'}); set columns.{kind} to the "
                            "key the rows use, or rename that key in the data")
    turns = record.get(schema.col("messages")) if schema.formatting == "sharegpt" else None
    first = turns[0] if isinstance(turns, list) and turns and isinstance(turns[0], dict) else None
    if first is None:
        return
    for tag in ("role_tag", "content_tag"):
        if schema.tag(tag) not in first:
            raise DataError(f"{path}: {schema.source} reads each turn's {tag.removesuffix('_tag')} from "
                            f"{schema.tag(tag)!r} (tags.{tag}), but the first turn has no such key (its keys: "
                            f"{', '.join(map(str, first))}); set tags.{tag} to the key the turns use")


def _check_named_columns(schema: DatasetSchema, seen: set, path: Path) -> None:
    """Every column the entry names must be in some row (LLaMA-Factory would fail on it too)."""
    for kind, key in schema.named:
        if key not in seen:
            raise DataError(f"{path}: {schema.source} names columns.{kind}: {key!r}, but no row has a {key!r} key; "
                            f"remove columns.{kind} or set it to the key the rows use")


def tokenize_file(path: str | Path, tokenizer, opts: PreprocessOptions,
                  progress: Optional[Progress] = None) -> tuple[list[dict], PreprocessStats]:
    """Rows ready for the collator, and the stats; a bad row is dropped and reported, or raises with on_error=fail.
    `progress(rows, done, total)` is called as the file is read."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} not found")
    stats = PreprocessStats(source=str(path), options=asdict(opts))
    want, schema = data_schema(path, opts.format)
    stats.dataset_info = schema.source
    if schema.ranking or schema.kto:
        kind, stage = ("preference data (ranking: true)", "dpo or rm") if schema.ranking else ("KTO data", "kto")
        raise DataError(f"{path}: {schema.source} describes {kind}, which supervised fine-tuning cannot use; "
                        f"set stage: {stage} to train on it")
    formats: Counter[str] = Counter()
    examples: list[tuple[list[int], list[int]]] = []
    seen: set = set()  # keys of the rows, when a dataset_info.json entry says which ones they must have
    for line_no, record in _read_jsonl(path, stats, opts, progress):
        if schema.formatting and isinstance(record, dict):
            if not seen:
                _check_first_row(schema, record, path)
            seen.update(record)
        try:
            fmt, messages = to_messages(record, want, schema)
            tools = record_tools(record, schema) if fmt == "sharegpt" else None
            ids, labels = tokenize_messages(tokenizer, messages, opts.train_on_prompt, tools)
        except RecordError as e:
            _drop(stats, opts, path, line_no, str(e))
            continue
        if len(ids) > opts.max_seq_len:
            ids, labels = ids[: opts.max_seq_len], labels[: opts.max_seq_len]
            if all(x == IGNORE_INDEX for x in labels):
                _drop(stats, opts, path, line_no, f"the prompt alone fills max_seq_len={opts.max_seq_len}")
                continue
            stats.truncated += 1
        formats[fmt] += 1
        examples.append((ids, labels))
        stats.tokens += len(ids)
        stats.trainable_tokens += sum(x != IGNORE_INDEX for x in labels)
        stats.max_tokens = max(stats.max_tokens, len(ids))
    if schema.named:
        _check_named_columns(schema, seen, path)
    if not examples:
        raise DataError(f"{path}: no usable rows ({len(stats.dropped)} dropped: {_first_reasons(stats)})")
    pad_id = pad_token_id(tokenizer)
    if opts.packing:
        rows = pack_rows(examples, opts.max_seq_len, opts.pad_to_multiple_of, pad_id)
    else:
        rows = [pad_row(ids, labels, opts.pad_to_multiple_of, pad_id) for ids, labels in examples]
    stats.rows, stats.sequences, stats.formats = len(examples), len(rows), dict(formats)
    stats.padded_tokens = sum(len(r["input_ids"]) for r in rows)
    return rows, stats


def _first_reasons(stats: PreprocessStats) -> str:
    unit = "row" if stats.layout == "json" else "line"
    shown = [f"{unit} {d['line']}: {d['reason']}" for d in stats.dropped[:3]]
    return "; ".join(shown) or "the file is empty"


def pad_token_id(tokenizer) -> int:
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if value is not None:
            return int(value)
    return 0


def save_dataset(rows: list[dict], stats: PreprocessStats, out_dir: str | Path) -> Path:
    """Arrow dataset + stats.json, written to a temp dir and renamed so a half-written output never exists."""
    from datasets import Dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    out = Path(out_dir)
    if out.exists() and not (out / STATS_FILE).is_file():
        raise DataError(f"{out} exists and is not a preprocess output; choose another --out")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    columns = {key: [r[key] for r in rows] for key in rows[0]}
    Dataset.from_dict(columns).save_to_disk(str(tmp))
    (tmp / STATS_FILE).write_text(stats.to_json(), encoding="utf-8")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def load_dataset_rows(data_dir: str | Path) -> tuple[list[dict], dict]:
    """Rows and stats of a `save_dataset` output."""
    from datasets import load_from_disk
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    data_dir = Path(data_dir)
    stats_path = data_dir / STATS_FILE
    if not stats_path.is_file():
        raise DataError(f"{data_dir} is not a preprocessed dataset (no {STATS_FILE}); run `mlc-cli preprocess` first")
    ds = load_from_disk(str(data_dir))
    return ds.to_list(), json.loads(stats_path.read_text(encoding="utf-8"))


def preprocess_file(path: str | Path, out_dir: str | Path, tokenizer, opts: PreprocessOptions, model: str = "",
                    progress: Optional[Progress] = None) -> PreprocessStats:
    rows, stats = tokenize_file(path, tokenizer, opts, progress)
    stats.model = model
    save_dataset(rows, stats, out_dir)
    return stats
