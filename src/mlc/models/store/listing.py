"""What the store can tell about its models: every known or pulled model listed, one model's manifest and config."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlc.models.store.hub_names import SHORT_NAMES
from mlc.models.store.known_models import KNOWN_MODELS
from mlc.models.store.manifest import read_manifest
from mlc.models.store.paths import is_pulled, pulled_names, store_path


@dataclass
class StoreEntry:
    name: str
    pulled: bool
    path: Path
    revision: str | None = None
    size_bytes: int = 0
    description: str = ""
    source: dict[str, Any] = field(default_factory=dict)


def list_models() -> list[StoreEntry]:
    """Every known model and GLM short name (pulled or not) and every other model in the store (converted .gguf
    files, hub pulls)."""
    entries = []
    for name in sorted(set(KNOWN_MODELS) | set(SHORT_NAMES) | set(pulled_names())):
        known = KNOWN_MODELS.get(name)
        short = SHORT_NAMES.get(name)
        description = known.description if known else f"{short.title}: {short.hf_repo}" if short else ""
        entry = StoreEntry(name, is_pulled(name), store_path(name), description=description)
        if entry.pulled:
            manifest = read_manifest(name)
            entry.revision = manifest.get("revision")
            entry.source = manifest.get("source", {})
            entry.size_bytes = sum(int(f.get("size", 0)) for f in manifest.get("files", {}).values())
        elif known:
            entry.revision, entry.source = known.revision, known.source()
        elif short:
            entry.revision, entry.source = "commit resolved at pull", {"kind": "hf-hub", "repo": short.hf_repo}
        entries.append(entry)
    return entries


def info(name: str) -> dict[str, Any]:
    """The manifest plus a summary of config.json."""
    manifest = read_manifest(name)
    config_path = store_path(name) / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    keys = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings", "dtype")
    return {**manifest, "path": str(store_path(name)), "config": {k: config[k] for k in keys if k in config}}
