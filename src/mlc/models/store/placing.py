"""Putting a finished model into the store: prepared beside its entries (a hidden dir under `$MLC_HOME/models`) and
renamed into place whole, so that no half-written model is ever visible under its name."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlc.config.paths import models_dir
from mlc.errors import IntegrityError, ModelNotFoundError
from mlc.models.store.manifest import read_manifest, write_manifest
from mlc.models.store.paths import is_pulled


@dataclass
class PullResult:
    name: str
    path: Path
    converted: bool  # False: it was already in the store
    seconds: float
    detail: str = ""  # what was pulled, for the one line `models pull` prints (a hub pull's commit and size)


def move_into_store(name: str, ready: Path) -> Path:
    """`ready` (a model dir with its manifest, on the store's file system) renamed to the store entry `name`; an
    older copy is set aside first and removed once the new one is in place."""
    final = models_dir() / name
    old = final.with_name(f".old-{name}-{os.getpid()}-{time.monotonic_ns()}") if final.exists() else None
    if old is not None:
        os.rename(final, old)
    try:
        os.rename(ready, final)
    except OSError:
        if old is not None and not final.exists():
            os.rename(old, final)
            old = None
        if not is_pulled(name):  # a concurrent pull that finished first is as good as ours
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return final


def convert_into_store(name: str, gguf_path: Path, source: dict[str, Any], revision: str,
                       gguf_sha256: str | None = None) -> Path:
    """A GGUF kept as it is beside its config.json and tokenizer, in a temp dir next to the target, then moved into
    place; `gguf_sha256` is its hash when already checked (not read again for the manifest)."""
    from mlc.models.gguf.convert import GGUF_FILE, gguf_into_dir

    root = models_dir()
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{name}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        report = gguf_into_dir(gguf_path, tmp)
        write_manifest(tmp, name, source, revision, report, {GGUF_FILE: gguf_sha256} if gguf_sha256 else None)
        return move_into_store(name, tmp)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def current(name: str) -> bool:
    """The store's copy was made by this converter (an older one wrote an fp32 copy of the weights: pulling again
    replaces it with the GGUF itself)."""
    from mlc.models.gguf.convert import CONVERTER_VERSION

    try:
        return read_manifest(name).get("converter", {}).get("gguf_converter") == CONVERTER_VERSION
    except (IntegrityError, ModelNotFoundError):
        return False
