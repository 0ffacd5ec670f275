"""Which of a hub repo's files a pull downloads: what serving reads (config, tokenizer, chat template, safetensors)
plus `--include` patterns, or one GGUF picked by its quant tag the way llama.cpp's `-hf ORG/NAME:QUANT` picks it.
Pickled weights are refused; so are split GGUFs, which mlc's GGUF reader does not read."""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatch

from mlc.errors import ModelFormatError, ModelNotFoundError

SERVING = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
           "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
           "chat_template.json", "*.safetensors", "*.safetensors.index.json")
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")  # llama.cpp's pick when `-hf` names no quant
SPLIT = re.compile(r"^(.+)-(\d{5})-of-(\d{5})$", re.IGNORECASE)
TAG = re.compile(r"[-.]([A-Za-z0-9_]+)$")


@dataclass(frozen=True)
class RemoteFile:
    """A file as the hub lists it: its size, and the hashes it publishes (LFS sha256; the git blob sha1)."""

    name: str
    size: int
    sha256: str | None = None  # LFS files only
    blob_id: str | None = None  # git's blob sha1: the content hash of a non-LFS file


@dataclass
class Selection:
    files: list[RemoteFile]
    gguf: RemoteFile | None = None  # the GGUF picked by its quant: converted once downloaded

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def select_files(repo: str, files: list[RemoteFile], include: tuple[str, ...] = (),
                 quant: str | None = None) -> Selection:
    """The files to download, config.json first (it is small, and `plan` reads it before the weights come)."""
    top = [f for f in files if "/" not in f.name]
    weights = [f for f in top if fnmatch(f.name, "*.safetensors")]
    if quant is None and not weights and gguf_models(files):
        quant = default_quant(files)
    if quant is not None:
        gguf = pick_gguf(repo, files, quant)
        return Selection([gguf, *_included(files, include, exclude={gguf.name})], gguf)
    if not weights:
        raise ModelFormatError(_no_weights(repo, files))
    if "config.json" not in {f.name for f in top}:
        raise ModelFormatError(f"{repo} has *.safetensors but no config.json at its top level, so it is not a "
                               "transformers checkpoint mlc can load; pick a repo (or a revision) that has one")
    chosen = [f for f in top if any(fnmatch(f.name, p) for p in SERVING) and not _duplicate(f, weights)]
    chosen += _included(files, include, exclude={f.name for f in chosen})
    return Selection(sorted(chosen, key=lambda f: (f.name != "config.json", f.size, f.name)))


def _included(files: list[RemoteFile], include: tuple[str, ...], exclude: set[str]) -> list[RemoteFile]:
    return [f for f in files if f.name not in exclude and any(fnmatch(f.name, p) for p in include)]


def _duplicate(f: RemoteFile, weights: list[RemoteFile]) -> bool:
    """Mistral-style `consolidated.safetensors` repeats the sharded weights in another layout: skip it."""
    return f.name.startswith("consolidated") and len(weights) > 1


def _no_weights(repo: str, files: list[RemoteFile]) -> str:
    pickles = [f.name for f in files if any(fnmatch(f.name.rsplit("/", 1)[-1], p) for p in PICKLES)]
    if pickles:
        shown = ", ".join(pickles[:3]) + (", ..." if len(pickles) > 3 else "")
        return (f"{repo} has only pickled PyTorch weights ({shown}) and no *.safetensors: mlc pulls safetensors "
                "only, because loading a pickle runs code from the file. Look for a safetensors revision of the repo "
                "(its `refs/pr/N` conversion: ORG/NAME@refs/pr/N) or another repo of the model")
    names = ", ".join(f.name for f in files[:8]) or "no files"
    return f"{repo} has no weights mlc reads (*.safetensors, or *.gguf with :QUANT); it holds {names}"


def split_info(name: str) -> tuple[str, str, int, int]:
    """llama.cpp's `get_gguf_split_info`: (prefix, quant tag, part, parts) of a .gguf name."""
    prefix = name[: -len(".gguf")]
    part, parts = 1, 1
    split = SPLIT.match(prefix)
    if split:
        prefix, part, parts = split.group(1), int(split.group(2)), int(split.group(3))
    tag = TAG.search(prefix)
    return prefix, tag.group(1).upper() if tag else "", part, parts


def gguf_models(files: list[RemoteFile]) -> list[RemoteFile]:
    """The model GGUFs: not a vision projector (mmproj) or an importance matrix."""
    return [f for f in files if f.name.lower().endswith(".gguf")
            and not any(k in f.name.rsplit("/", 1)[-1].lower() for k in ("mmproj", "imatrix"))]


def available_quants(files: list[RemoteFile]) -> list[str]:
    seen: dict[str, int] = {}
    for f in gguf_models(files):
        _, tag, _, parts = split_info(f.name)
        seen.setdefault(tag or f.name, parts)
    return [tag if parts == 1 else f"{tag} (split in {parts})" for tag, parts in seen.items()]


def default_quant(files: list[RemoteFile]) -> str:
    """What llama.cpp takes without a quant: Q4_K_M, else Q8_0, else the first model GGUF's tag."""
    for quant in DEFAULT_QUANTS:
        if _matching(files, quant):
            return quant
    return split_info(gguf_models(files)[0].name)[1] or gguf_models(files)[0].name


def _matching(files: list[RemoteFile], quant: str) -> list[RemoteFile]:
    pattern = re.compile(re.escape(quant) + r"[.-]", re.IGNORECASE)
    return [f for f in gguf_models(files) if pattern.search(f.name) and split_info(f.name)[2] == 1]


def pick_gguf(repo: str, files: list[RemoteFile], quant: str) -> RemoteFile:
    """The GGUF whose name carries `quant` (case-insensitive, followed by `.` or `-`, as llama.cpp matches it)."""
    matching = _matching(files, quant) or [f for f in gguf_models(files) if f.name == quant]
    if not matching:
        quants = available_quants(files)
        listed = f"available: {', '.join(quants)}" if quants else "it has no GGUF files"
        raise ModelNotFoundError(f"{repo} has no GGUF with quant {quant!r} ({listed}); write {repo}:QUANT")
    first = matching[0]
    prefix, _, _, parts = split_info(first.name)
    if parts > 1:
        raise ModelFormatError(
            f"{repo}:{quant} is split in {parts} files ({first.name}, ...), and mlc reads one-file GGUFs only: "
            f"merge them with llama.cpp (`llama-gguf-split --merge {first.name} merged.gguf`) and pull the "
            "merged file with `mlc-cli models pull ./merged.gguf`, or pick a quant that is one file")
    return first
