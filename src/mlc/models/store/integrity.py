"""File integrity against a manifest: manifest names confined to their model dir, full sha256, and the cheap
load-time check (size plus a sha256 of a few fixed-offset chunks, `sampled_sha256`, recorded at pull time)."""

from __future__ import annotations

import hashlib
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from mlc.errors import IntegrityError

SAMPLE_CHUNK = 1 << 16  # bytes per sampled chunk
SAMPLE_COUNT = 16  # chunks per file: first, last and evenly spaced between; smaller files are hashed whole


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sample_offsets(size: int, chunk: int = SAMPLE_CHUNK, count: int = SAMPLE_COUNT) -> list[int]:
    """Where the sampled chunks start; fixed by the size alone, so pull time and load time read the same bytes."""
    if size <= chunk * count:
        return [0]
    step = (size - chunk) / (count - 1)
    return [round(i * step) for i in range(count)]


def sampled_sha256(path: Path, chunk: int = SAMPLE_CHUNK, count: int = SAMPLE_COUNT) -> str:
    size = path.stat().st_size
    if size <= chunk * count:
        return sha256_file(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for offset in sample_offsets(size, chunk, count):
            f.seek(offset)
            digest.update(f.read(chunk))
    return digest.hexdigest()


def confined_path(root: Path, rel: Any) -> Path:
    """`root / rel`, refused unless it stays inside root: no absolute names, no `..`, no symlink leading out."""
    if not isinstance(rel, str) or not rel or PurePosixPath(rel).is_absolute() or PureWindowsPath(rel).is_absolute():
        raise IntegrityError(f"{root}: manifest entry {rel!r} is not a relative file name; the manifest is damaged "
                             "or was tampered with")
    path = root / rel
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        raise IntegrityError(f"{root}: manifest entry {rel!r} points outside the model directory; the manifest is "
                             "damaged or was tampered with") from None
    return path


def check_files(root: Path, files: Any, full: bool, chunk: int = SAMPLE_CHUNK, count: int = SAMPLE_COUNT) -> list[str]:
    """What differs from the manifest's `files`, one phrase per file; every name is confined before any is read.
    `full`: every byte's sha256; else sizes plus `sampled_sha256` (made with `chunk` x `count`) where recorded."""
    if not isinstance(files, dict) or not all(isinstance(r, dict) and "size" in r and "sha256" in r
                                              for r in files.values()):
        raise IntegrityError(f"{root}: the manifest's file list is malformed")
    paths = {rel: confined_path(root, rel) for rel in files}
    problems = []
    for rel, expected in files.items():
        path = paths[rel]
        if not path.is_file():
            problems.append(f"{rel} is missing")
        elif path.stat().st_size != expected["size"]:
            problems.append(f"{rel} has size {path.stat().st_size}, expected {expected['size']}")
        elif full and sha256_file(path) != expected["sha256"]:
            problems.append(f"{rel} has a different sha256 than recorded")
        elif not full and "sampled_sha256" in expected and (
                sampled_sha256(path, chunk, count) != expected["sampled_sha256"]):
            problems.append(f"{rel} has a different sha256 than recorded")
    return problems
