"""Open a GGUF file (llama.cpp's format) with the `gguf` package: its metadata as python values, its tensors mapped."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlc.errors import ModelFormatError


@dataclass
class GGUFFile:
    """An opened GGUF: its metadata (key -> python value) and its tensors (memory-mapped)."""

    path: Path
    reader: Any
    metadata: dict[str, Any]

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
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise ModelFormatError(f"{path} does not exist or is not a file; pass the path of a .gguf file")
    try:
        reader = GGUFReader(str(path))
        metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    except Exception as e:  # the reader raises ValueError, IndexError or struct errors on damaged files
        raise ModelFormatError(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); re-download it") from None
    return GGUFFile(path, reader, metadata)
