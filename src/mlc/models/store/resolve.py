"""What a model name, an HF checkpoint dir, an `org/name` in the HF cache or a .gguf file resolves to."""

from __future__ import annotations

from pathlib import Path

from mlc.errors import ModelFormatError, ModelNotFoundError
from mlc.models.store.hf import (
    cached_snapshot,
    check_snapshot,
    foreign_format_message,
    looks_like_repo_id,
    not_in_cache_message,
)
from mlc.models.store.paths import is_pulled, looks_like_path, not_pulled_message, store_path
from mlc.models.store.pulling import pull_gguf


def resolve_model_dir(model: str | Path) -> Path:
    """A store name, an HF checkpoint dir, an `org/name` in the local HF cache or a .gguf file (converted into the
    store once) -> a checkpoint dir."""
    path = Path(model).expanduser()
    foreign = foreign_format_message(path)
    if foreign:
        raise ModelFormatError(foreign)
    if path.is_dir():
        if not (path / "config.json").is_file():
            tokenizer_only = " (it holds only a tokenizer, which is enough for `mlc-cli preprocess`)" if (
                _has_tokenizer(path)) else ""
            raise ModelFormatError(
                f"{path} has no config.json{tokenizer_only}; point at an HF checkpoint directory "
                "(config.json + *.safetensors)"
            )
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelFormatError(f"{path} is a file but not a .gguf; pass a checkpoint directory or a .gguf file")
        return pull_gguf(path).path
    name = str(model)
    if looks_like_repo_id(name):
        snapshot = cached_snapshot(name)
        if snapshot is not None:
            return check_snapshot(name, snapshot)
        raise ModelNotFoundError(not_in_cache_message(name))
    if looks_like_path(name):
        raise ModelNotFoundError(f"{name} does not exist; pass an existing checkpoint directory or .gguf file")
    if is_pulled(name):
        return store_path(name)
    raise ModelNotFoundError(not_pulled_message(name))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _has_tokenizer(path: Path) -> bool:
    return any((path / f).is_file() for f in TOKENIZER_FILES)


def resolve_tokenizer_dir(model: str | Path) -> Path:
    """Where a tokenizer is read from: a directory that holds only a tokenizer (the tutorial's
    `models/glm5-tokenizer/`), or anything `resolve_model_dir` takes."""
    path = Path(model).expanduser()
    if path.is_dir() and not (path / "config.json").is_file() and _has_tokenizer(path):
        return path
    return resolve_model_dir(model)
