"""A store model's files against its manifest: every byte (`models verify`) or sizes plus sampled hashes (each load)."""

from __future__ import annotations

import json
import logging
import os
import shlex
from pathlib import Path
from typing import Any

from mlc.config.paths import models_dir
from mlc.errors import IntegrityError
from mlc.models.store.integrity import check_files, sampled_sha256
from mlc.models.store.manifest import read_manifest, sampling_record
from mlc.models.store.paths import MANIFEST, store_path

log = logging.getLogger("mlc.models")


def verify(name: str, full: bool = True) -> dict[str, dict[str, Any]]:
    """Check the model's files against its manifest; IntegrityError names the files that differ and says to re-pull.
    `full`: every byte's sha256 (`models verify`, `--verify`); else sizes plus sampled hashes (every load)."""
    manifest = read_manifest(name)
    root = store_path(name)
    sampling = _sampling(name, manifest)
    # A manifest from before sampled hashes: hash every byte once, then record the samples so later loads stay cheap.
    upgrade = sampling is None and os.access(root, os.W_OK)
    if not full and sampling is None and not upgrade:
        log.warning("model %r: its manifest predates sampled hashes and %s is read-only, so only file sizes are "
                    "checked; `mlc-cli models verify %s` checks every byte", name, root, name)
    try:
        problems = check_files(root, manifest.get("files", {}), full or upgrade, *(sampling or ()))
    except IntegrityError as e:
        raise IntegrityError(f"model {name!r}: {e.message}; {_repull(name, manifest)}") from None
    if problems:
        raise IntegrityError(f"model {name!r} failed verification: {'; '.join(problems)}; {_repull(name, manifest)}")
    if upgrade:
        _record_samples(root, manifest)
    return manifest.get("files", {})


def check_at_load(model_dir: Path, full: bool = False) -> None:
    """Before weights are read: a store model's cheap check (sizes + sampled hashes), or every byte with `full`.
    Checkpoint dirs outside the store have no manifest of ours and are not checked."""
    path = Path(model_dir).resolve()
    if path.parent == models_dir().resolve() and (path / MANIFEST).is_file():
        verify(path.name, full=full)


def _sampling(name: str, manifest: dict[str, Any]) -> tuple[int, int] | None:
    raw = manifest.get("sampling")
    if raw is None:
        return None
    try:
        chunk, count = int(raw["chunk"]), int(raw["count"])
    except (TypeError, KeyError, ValueError):
        chunk = count = 0
    if chunk < 1 or count < 2:
        raise IntegrityError(f"model {name!r}: the manifest's sampling record {raw!r} is malformed; "
                             f"{_repull(name, manifest)}")
    return chunk, count


def _repull(name: str, manifest: dict[str, Any]) -> str:
    source = manifest.get("source") or {}
    if source.get("kind") in ("hf-hub", "modelscope") and source.get("spec"):
        return f"run `mlc-cli models pull {shlex.quote(str(source['spec']))} --force` to download it again"
    target = source["path"] if source.get("kind") == "gguf-file" and source.get("path") else name
    return f"run `mlc-cli models pull {shlex.quote(str(target))} --force` to re-convert it"


def _record_samples(root: Path, manifest: dict[str, Any]) -> None:
    """Add sampled hashes to a manifest whose files were just fully verified (atomic replace; best effort)."""
    for rel, record in manifest["files"].items():
        record["sampled_sha256"] = sampled_sha256(root / rel)
    manifest["sampling"] = sampling_record()
    tmp = root / f".{MANIFEST}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(tmp, root / MANIFEST)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        log.warning("could not record sampled hashes in %s (%s); the next load checks every byte again",
                    root / MANIFEST, e)
