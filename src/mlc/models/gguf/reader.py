"""Open a GGUF file (llama.cpp's format): its metadata as python values and its tensors mapped from the file, read
straight from the header (`open_gguf`, what converting needs: the vocabulary's arrays too; `open_gguf_tensors`,
what loading the weights needs: arrays skipped, since the store has the tokenizer as tokenizer.json already). The
`gguf` package's reader takes seconds over a 150,000-token vocabulary; this one reads fixed-size arrays at once."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlc.errors import ModelFormatError


@dataclass
class GGUFFile:
    """An opened GGUF: its metadata (key -> python value) and its tensors (memory-mapped)."""

    path: Path
    reader: Any
    metadata: dict[str, Any]
    mapping: mmap.mmap | None = None

    def release(self, tensors: list) -> None:
        """Drop the mapped pages of `tensors` (whose bytes were copied out) from this process's resident memory. The
        file stays in the page cache, and a later read of them faults them back in: only RSS changes. Loading
        releases each matrix once it is repacked, so the pages of the whole file are never resident at once."""
        if self.mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        base = np.frombuffer(self.mapping, dtype=np.uint8).__array_interface__["data"][0]
        for t in tensors:
            start = t.data.__array_interface__["data"][0] - base
            end = start + t.data.nbytes
            start -= start % mmap.PAGESIZE  # whole pages: the one shared with the tensor before faults back if read
            if end > start:
                self.mapping.madvise(mmap.MADV_DONTNEED, start, min(end, len(self.mapping)) - start)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "<missing>"))

    @property
    def tensors(self) -> list:
        return list(self.reader.tensors)

    def tensor_names(self) -> set[str]:
        return {t.name for t in self.reader.tensors}

    def arch_key(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)


def open_gguf(path: str | Path) -> GGUFFile:
    """Every metadata value (the vocabulary's arrays included) and the tensors, mapped."""
    return _open(_existing(path), arrays=True)


def _existing(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise ModelFormatError(f"{path} does not exist or is not a file; pass the path of a .gguf file")
    return path


@dataclass
class GGUFTensor:
    """One tensor as the `gguf` package's reader describes it: `shape` innermost dimension first, `data` its bytes
    `[rows, bytes per row]` mapped from the file."""

    name: str
    shape: tuple[int, ...]
    tensor_type: int
    data: np.ndarray


@dataclass
class _Tensors:
    """A reader stand-in holding only the tensors."""

    tensors: list[GGUFTensor]


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.at, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.buf):
            raise ModelFormatError(f"{self.path} ends inside its header; the file is truncated: download it again")
        value = struct.unpack_from(fmt, self.buf, self.at)[0]
        self.at += size
        return value

    def skip(self, size: int) -> int:
        """Moves past `size` bytes; returns where they start."""
        if self.at + size > len(self.buf):
            raise ModelFormatError(f"{self.path} ends inside its header; the file is truncated: download it again")
        self.at += size
        return self.at - size

    def string(self) -> str:
        n = self.take("<Q")
        start = self.skip(n)
        return bytes(self.buf[start : start + n]).decode("utf-8", errors="replace")

    def value(self, kind: int, keep: bool) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ModelFormatError(f"{self.path}: metadata value type {kind} is unknown; the file is damaged")
        item, count = self.take("<I"), self.take("<Q")
        if item in _SCALARS:  # fixed-size items: read (or skipped) at once
            start = self.skip(count * struct.calcsize(_SCALARS[item]))
            if not keep:
                return None
            return np.frombuffer(self.buf, np.dtype(_SCALARS[item]), count, start).tolist()
        values = [self.value(item, keep) for _ in range(count)]
        return values if keep else None


def open_gguf_tensors(path: str | Path) -> GGUFFile:
    """The tensors of a GGUF, mapped, and its scalar metadata (arrays skipped), in milliseconds."""
    return _open(_existing(path), arrays=False)


def _open(path: Path, arrays: bool) -> GGUFFile:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with path.open("rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf, path)
    if bytes(buf[:4]) != b"GGUF":
        raise ModelFormatError(f"{path} is not a GGUF file (no GGUF magic); re-download it")
    cur.at = 4
    version, n_tensors, n_kv = cur.take("<I"), cur.take("<Q"), cur.take("<Q")
    if version < 2:
        raise ModelFormatError(f"{path} is GGUF version {version}; convert it again with a current llama.cpp")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key, kind = cur.string(), cur.take("<I")
        value = cur.value(kind, keep=arrays)
        if value is not None:
            metadata[key] = value
    infos = []
    for _ in range(n_tensors):
        name, dims = cur.string(), cur.take("<I")
        shape = tuple(cur.take("<Q") for _ in range(dims))
        infos.append((name, shape, cur.take("<I"), cur.take("<Q")))
    align = int(metadata.get("general.alignment", 32))
    start = -(-cur.at // align) * align
    data = np.frombuffer(buf, dtype=np.uint8)
    tensors = []
    for name, shape, kind, offset in infos:
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise ModelFormatError(f"{path}: tensor {name!r} has type {kind}, which this mlc does not know") from None
        rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        row_bytes = shape[0] // block * size
        begin = start + offset
        if begin + rows * row_bytes > data.size:
            raise ModelFormatError(f"{path}: tensor {name!r} runs past the end of the file; the file is truncated: "
                                   "download it again")
        tensors.append(GGUFTensor(name, shape, kind, data[begin : begin + rows * row_bytes].reshape(rows, row_bytes)))
    return GGUFFile(path, _Tensors(tensors), metadata, buf)
