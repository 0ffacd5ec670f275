"""Fake store models for the store tests: random weights with a manifest as `pull` writes it, a flipped byte, and
the message a failed verification gives."""

from __future__ import annotations

import json
import os
from pathlib import Path

from mlc.models import store


def fake_store_model(home: Path, name: str = "fake", size: int = 4 << 20, sampled: bool = True) -> Path:
    """A store model of random bytes with a manifest as `pull` writes it; 4 MiB of weights, mostly between samples."""
    root = home / "models" / name
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "model.safetensors").write_bytes(os.urandom(size))
    files = store.file_records(root)
    manifest = {"name": name, "revision": "test", "source": {"kind": "test"}, "files": files}
    if sampled:
        manifest["sampling"] = store.sampling_record()
    else:  # as written before sampled hashes existed
        for rec in files.values():
            del rec["sampled_sha256"]
    (root / store.MANIFEST).write_text(json.dumps(manifest))
    return root


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def between_samples(size: int) -> int:
    from mlc.models.store.integrity import SAMPLE_CHUNK, sample_offsets

    first, second = sample_offsets(size)[:2]
    assert second > first + SAMPLE_CHUNK + 1000
    return first + SAMPLE_CHUNK + 500


FAILED = r"model 'fake' failed verification: model\.safetensors has a different sha256 than recorded; " \
         r"run `mlc-cli models pull fake --force` to re-convert it$"
