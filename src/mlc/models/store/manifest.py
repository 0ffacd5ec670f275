"""The manifest each pulled model carries (source, revision, sha256 + size of every file): written, and read back."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mlc.errors import IntegrityError, ModelNotFoundError
from mlc.models.store.integrity import SAMPLE_CHUNK, SAMPLE_COUNT, sampled_sha256, sha256_file
from mlc.models.store.paths import MANIFEST, not_pulled_message, store_path


def file_records(model_dir: Path, known_sha256: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """sha256, size and sampled hash of every file; `known_sha256` gives the hashes already checked (a pull from a hub
    verified each file against the hash the hub publishes), so large files are not read twice."""
    known = known_sha256 or {}
    records = {}
    for p in sorted(model_dir.rglob("*")):
        rel = p.relative_to(model_dir).as_posix()
        if p.is_file() and p.name != MANIFEST:
            records[rel] = {"sha256": known.get(rel) or sha256_file(p), "size": p.stat().st_size,
                            "sampled_sha256": sampled_sha256(p)}
    return records


def sampling_record() -> dict[str, int]:
    """How `sampled_sha256` was made, stored in the manifest so the load-time check reads the same bytes."""
    return {"chunk": SAMPLE_CHUNK, "count": SAMPLE_COUNT}


def read_manifest(name: str) -> dict[str, Any]:
    path = store_path(name) / MANIFEST
    if not path.is_file():
        raise ModelNotFoundError(not_pulled_message(name))
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise IntegrityError(f"{path} is unreadable ({e}); run `mlc-cli models pull {name} --force`") from None
    if not isinstance(manifest, dict):
        raise IntegrityError(f"{path} is not a manifest object; run `mlc-cli models pull {name} --force`")
    return manifest


def write_manifest(model_dir: Path, name: str, source: dict[str, Any], revision: str, report=None,
                   known_sha256: dict[str, str] | None = None) -> None:
    """The manifest of a model about to enter the store; `report` is a GGUF conversion's (None: files as pulled)."""
    from mlc import __version__
    from mlc.models.gguf.convert import CONVERTER_VERSION

    manifest: dict[str, Any] = {
        "name": name,
        "source": source,
        "revision": revision,
        "converted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "converter": {"mlc": __version__},
        "files": file_records(model_dir, known_sha256),
        "sampling": sampling_record(),
    }
    if report is not None:
        manifest["converter"]["gguf_converter"] = CONVERTER_VERSION
        manifest["conversion"] = {"tensor_types": report.tensor_types, "unmapped_gguf_keys": report.unmapped_keys}
    (model_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
