"""Model store (placeholder until the store lands): resolves local checkpoint directories."""

from __future__ import annotations

from pathlib import Path

from mlc.errors import ModelNotFoundError


def resolve_model_dir(model: str | Path) -> Path:
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    raise ModelNotFoundError(f"model {str(model)!r} not found; pass a checkpoint directory")
