"""What a model name, an HF checkpoint dir, a hub id (pulled into the store, or in the HF cache) or a .gguf file
resolves to. Nothing here downloads: a hub id that is not on this machine says how to pull it."""

from __future__ import annotations

from pathlib import Path

from mlc.config.paths import models_dir
from mlc.errors import ModelFormatError, ModelNotFoundError
from mlc.models.store.hf import cached_snapshot, check_snapshot, foreign_format_message, has_weights, not_local_message
from mlc.models.store.hub_names import HubSpec, parse_spec
from mlc.models.store.hub_pull import same_model
from mlc.models.store.known_models import KNOWN_MODELS
from mlc.models.store.manifest import read_manifest
from mlc.models.store.paths import is_pulled, looks_like_path, not_pulled_message, store_path
from mlc.models.store.pulling import pull_gguf


def resolve_model_dir(model: str | Path) -> Path:
    """A store name, an HF checkpoint dir, a hub id (`org/name[@rev][:QUANT]`, `modelscope:...`, a GLM short name)
    pulled into the store or in the local HF cache, or a .gguf file (converted into the store once) -> a checkpoint
    dir. An existing local path wins over a hub id of the same spelling."""
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
    spec = hub_spec(name)
    if spec is not None:
        found = local_hub_model(spec)
        if found is None:
            raise ModelNotFoundError(not_local_message(name, models_dir()))
        return found
    if looks_like_path(name):
        raise ModelNotFoundError(f"{name} does not exist; pass an existing checkpoint directory or .gguf file")
    if is_pulled(name):
        return store_path(name)
    raise ModelNotFoundError(not_pulled_message(name))


def hub_spec(name: str) -> HubSpec | None:
    """`name` as a hub id; None for a known model (its name is the store's) or anything that is not one."""
    return None if name in KNOWN_MODELS else parse_spec(name)


def local_hub_model(spec: HubSpec) -> Path | None:
    """The spec's model on this machine: its store entry (a matching revision, where one is asked), else, for a
    Hugging Face repo without a quant, a snapshot with weights in the local HF cache."""
    name = spec.store_name
    if is_pulled(name) and same_model(spec, read_manifest(name).get("source") or {}):
        return store_path(name)
    if spec.source == "hf" and spec.quant is None:
        snapshot = cached_snapshot(spec.repo, spec.revision)
        if snapshot is not None and has_weights(snapshot):
            return check_snapshot(spec.repo, snapshot)
    return None


def hub_config(spec: HubSpec) -> Path | None:
    """config.json of a hub id on this machine: pulled, or in the HF cache (where `plan --pull` puts it alone)."""
    found = local_hub_model(spec)
    if found is not None:
        return found / "config.json"
    snapshot = cached_snapshot(spec.repo, spec.revision) if spec.source == "hf" else None
    return snapshot / "config.json" if snapshot is not None and (snapshot / "config.json").is_file() else None


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
