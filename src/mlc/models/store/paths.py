"""Where the store under `$MLC_HOME/models` keeps each model, and which models it holds (those with a manifest)."""

from __future__ import annotations

import os
from pathlib import Path

from mlc.config.paths import models_dir
from mlc.models.store.known_models import KNOWN_MODELS

MANIFEST = "manifest.json"


def store_path(name: str) -> Path:
    return models_dir() / name


def is_pulled(name: str) -> bool:
    return (store_path(name) / MANIFEST).is_file()


def pulled_names() -> list[str]:
    root = models_dir()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / MANIFEST).is_file() and not p.name.startswith("."))


def looks_like_path(model: str) -> bool:
    return os.sep in model or model.startswith((".", "~")) or model.endswith(".gguf")


def not_pulled_message(name: str) -> str:
    if name in KNOWN_MODELS:
        return f"model {name!r} is not in the store ({models_dir()}); run `mlc-cli models pull {name}`"
    others = [n for n in pulled_names() if n not in KNOWN_MODELS]
    return (
        f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))}; other models in the store: "
        f"{', '.join(others) or 'none'} (or pass an HF checkpoint directory, a .gguf file, or a hub id to pull: "
        "ORG/NAME or a GLM short name, see `mlc-cli models list`)"
    )
