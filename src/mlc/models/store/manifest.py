"""The manifest each pulled model carries (source, revision, sha256 + size of every file): written, and read back."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mlc.errors import IntegrityError, ModelNotFoundError
from mlc.models.store.integrity import SAMPLE_CHUNK, SAMPLE_COUNT, sampled_sha256, sha256_file
from mlc.models.store.paths import MANIFEST, not_pulled_message, store_path


def file_records(model_dir: Path) -> dict[str, dict[str, Any]]:
    return {
        p.relative_to(model_dir).as_posix(): {"sha256": sha256_file(p), "size": p.stat().st_size,
                                              "sampled_sha256": sampled_sha256(p)}
        for p in sorted(model_dir.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


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


def write_manifest(model_dir: Path, name: str, source: dict[str, Any], revision: str, report) -> None:
    from mlc import __version__
    from mlc.models.gguf.convert import CONVERTER_VERSION

    manifest = {
        "name": name,
        "source": source,
        "revision": revision,
        "converted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "converter": {"mlc": __version__, "gguf_converter": CONVERTER_VERSION},
        "conversion": {"tensor_types": report.tensor_types, "unmapped_gguf_keys": report.unmapped_keys},
        "files": file_records(model_dir),
        "sampling": sampling_record(),
    }
    (model_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
