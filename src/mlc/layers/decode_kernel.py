"""The C++ CPU kernels (`csrc/`), one build:

* decode attention (`decode_attention.cpp`): one query per sequence, attending over its context read in place
  through the page table, so a decode step skips the gather, the key padding and the masked SDPA; a sequence's
  result does not depend on its batch (each sequence and KV head is computed whole, in one order);
* the int4 and int8 GEMMs (`int4_linear.cpp`, `int8_linear.cpp`, `quant_gemm.h`; `layers/quant_linear.py`):
  activations as two int8 digits (about 16 bits), exact integer dot products, each row alone;
* RMSNorm, RoPE and SiLU x up for 16-bit models (`decode_attention.cpp`, `fused_ops.cpp`): one pass a row instead
  of several eager ops, with the eager ops' roundings.

It is built once per machine with torch's cpp_extension (the C++ compiler inductor uses too; `-O3 -march=native`)
into `$MLC_HOME/kernels/`, keyed by torch version and CPU, and loaded from there afterwards. Without a compiler, or
with `MLC_DECODE_KERNEL=0`, the torch ops run instead: SDPA (`layers/attention.py`, as every non-CPU device and
every quantized KV cache does), torch's int4 kernel, the eager elementwise ops.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger("mlc.layers")
SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("decode_attention.cpp", "int4_linear.cpp", "int8_linear.cpp", "fused_ops.cpp")]
# no -ffast-math: the sums keep the order the source gives them (batch invariance needs a fixed order, not this one);
# no contraction of a * b + c into one fma unless the source asks, so the fused ops round as the eager ops do
FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-fopenmp"]
STALE_LOCK_S = 600
FAILED = "build-failed.json"  # a failed build's reason, beside the build, until its sources or compiler change
_LOCK = threading.Lock()
_LOADED: dict[str, object] = {}


def decode_kernel():
    """`torch.ops.mlc_kernels.decode_attention`, built or loaded on first call; None when it cannot be."""
    if "op" not in _LOADED:
        with _LOCK:
            if "op" not in _LOADED:
                _LOADED["op"] = _load()
    return _LOADED["op"]


def cpu_op(name: str):
    """`torch.ops.mlc_kernels.<name>` from the same build (rms_norm, int4_linear, int8_linear, rope_neox,
    silu_mul); None without it. Looked up once: layers call this on every step."""
    if name not in _LOADED:
        op = getattr(torch.ops.mlc_kernels, name) if decode_kernel() is not None else None
        if op is not None and name in _FAKES and not getattr(op.default, "_mlc_fake", False):
            torch.library.register_fake(f"mlc_kernels::{name}")(_FAKES[name])  # what torch.compile traces
            op.default._mlc_fake = True
        _LOADED[name] = op
    return _LOADED[name]


def eager_cpu(*tensors: torch.Tensor) -> bool:
    """The fused elementwise kernels apply: CPU tensors, eager (not traced by torch.compile), nothing to
    differentiate (training keeps the eager ops, which autograd knows)."""
    return (all(t.device.type == "cpu" for t in tensors) and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


_FAKES = {"int4_linear": lambda x, packed, group: x.new_empty(x.shape[0], packed.shape[0] * 16),
          "int8_linear": lambda x, packed: x.new_empty(x.shape[0], packed.shape[0] * 16)}


def kernel_status() -> str:
    """For the startup log: which CPU kernels this process runs."""
    if decode_kernel() is None:
        return "torch ops (SDPA decode attention, torch's int4 and fbgemm's int8 kernels, eager RMSNorm/RoPE/SiLU)"
    return "C++ kernels (paged decode attention, int4 and int8 GEMMs, RMSNorm, RoPE, SiLU x up)"


def _cpu_key() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = os.uname().machine
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def kernels_off() -> bool:
    return os.environ.get("MLC_DECODE_KERNEL", "1").strip().lower() in ("0", "false", "off", "no")


def compiler() -> str | None:
    """The C++ compiler torch's cpp_extension would run (`$CXX`, else c++), as a path; None when there is none."""
    from torch.utils.cpp_extension import get_cxx_compiler

    return shutil.which(get_cxx_compiler())


def _build_dir() -> Path:
    from mlc.config.paths import mlc_home

    # MLC_KERNEL_MARCH: the -march to build for (default native); the tests build haswell (AVX2) and x86-64 (plain
    # C++) to check that every code path gives the native build's int4 results
    suffix = "" if _march() == "native" else f"-{_march()}"
    return mlc_home() / "kernels" / f"decode_attention-torch{torch.__version__}-{_cpu_key()}{suffix}"


def _march() -> str:
    return os.environ.get("MLC_KERNEL_MARCH", "native").strip() or "native"


def _attempt_key() -> str:
    """What a build attempt depends on: the sources, the flags and the compiler. A failure is remembered under it,
    so a fixed source or a newly installed compiler is tried again, and nothing else is."""
    digest = hashlib.sha256(f"{compiler()}|{_march()}|{FLAGS}".encode())
    for path in SOURCES + sorted((Path(__file__).parent / "csrc").glob("*.h")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def build_failure() -> str | None:
    """Why the last build on this machine failed, while nothing it depends on has changed; None if it did not."""
    marker = _build_dir() / FAILED
    try:
        record = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return record.get("reason") if record.get("key") == _attempt_key() else None


def _load():
    if kernels_off():
        return None
    if hasattr(torch.ops.mlc_kernels, "decode_attention"):  # another engine in this process loaded it
        return torch.ops.mlc_kernels.decode_attention
    return _build()


def _build():
    """Build (or load the earlier build of) the kernels into $MLC_HOME/kernels; None, remembered, when it fails."""
    build = _build_dir()
    failed = build_failure()
    if failed is not None:  # every process and tensor-parallel worker would fail the same way: say it, don't retry
        log.warning("the C++ CPU kernels failed to build on this machine earlier (%s); torch's ops run instead "
                    "(slower). Delete %s to try again", failed, build / FAILED)
        return None
    try:
        from torch.utils.cpp_extension import load

        build.mkdir(parents=True, exist_ok=True)
        lock = build / "lock"  # torch waits forever on the lock of a build that was killed; a build takes seconds
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            log.warning("removing the stale build lock %s (a build interrupted earlier)", lock)
            lock.unlink(missing_ok=True)
        load(name="mlc_decode_attention", sources=[str(p) for p in SOURCES],
             extra_cflags=[f"-march={_march()}", *FLAGS], extra_ldflags=["-fopenmp"], build_directory=str(build), is_python_module=False, verbose=False)
        return torch.ops.mlc_kernels.decode_attention
    except Exception as e:  # no compiler, a read-only home, an unsupported platform: SDPA serves
        lines = str(e).strip().splitlines() or [type(e).__name__]
        reason = next((ln.strip() for ln in lines if "error:" in ln), lines[-1])[:300]  # a compiler's first error
        _remember_failure(build, reason)
        log.warning("the C++ CPU kernels are not available (%s); torch's ops run instead (slower). "
                    "Without a C++ compiler, install one (g++); MLC_DECODE_KERNEL=0 skips trying", reason)
        return None


def _remember_failure(build: Path, reason: str) -> None:
    try:
        build.mkdir(parents=True, exist_ok=True)
        (build / FAILED).write_text(json.dumps({"key": _attempt_key(), "reason": reason}))
    except OSError:
        pass  # a read-only home: every process tries (and fails) on its own
