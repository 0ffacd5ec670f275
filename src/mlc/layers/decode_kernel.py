"""The C++ CPU kernels (`csrc/decode_attention.cpp`). Decode attention: one query per sequence, attending over its
context read in place through the page table, so a decode step skips the gather, the key padding and the masked
SDPA; a sequence's result does not depend on its batch (each sequence and KV head is computed whole, in one order).
RMSNorm for bf16/fp16 models: one pass a row instead of seven eager ops (`layers/norm.py`).

It is built once per machine with torch's cpp_extension (the C++ compiler inductor uses too; `-O3 -march=native`)
into `$MLC_HOME/kernels/`, keyed by torch version and CPU, and loaded from there afterwards. Without a compiler, or
with `MLC_DECODE_KERNEL=0`, decode attention runs on torch SDPA (`layers/attention.py`), as every non-CPU device
and every quantized KV cache does.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger("mlc.layers")
SOURCE = Path(__file__).parent / "csrc" / "decode_attention.cpp"
# no -ffast-math: the sums keep the order the source gives them (batch invariance needs a fixed order, not this one)
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]
STALE_LOCK_S = 600
_LOCK = threading.Lock()
_LOADED: dict[str, object] = {}


def decode_kernel():
    """`torch.ops.mlc_kernels.decode_attention`, built or loaded on first call; None when it cannot be."""
    if "op" not in _LOADED:
        with _LOCK:
            if "op" not in _LOADED:
                _LOADED["op"] = _load()
    return _LOADED["op"]


def rms_norm_kernel():
    """`torch.ops.mlc_kernels.rms_norm` (16-bit RMSNorm in one pass a row), from the same build; None without it.
    Looked up once: every norm of every layer calls this on each step."""
    if "rms_norm" not in _LOADED:
        _LOADED["rms_norm"] = torch.ops.mlc_kernels.rms_norm if decode_kernel() is not None else None
    return _LOADED["rms_norm"]


def kernel_status() -> str:
    """For the startup log and `doctor`: which decode attention this process runs."""
    return "C++ paged decode kernel" if decode_kernel() is not None else "torch SDPA (gathered, padded)"


def _cpu_key() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = os.uname().machine
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def _load():
    if os.environ.get("MLC_DECODE_KERNEL", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    if hasattr(torch.ops.mlc_kernels, "decode_attention"):  # another engine in this process loaded it
        return torch.ops.mlc_kernels.decode_attention
    from mlc.config.paths import mlc_home

    build = mlc_home() / "kernels" / f"decode_attention-torch{torch.__version__}-{_cpu_key()}"
    try:
        from torch.utils.cpp_extension import load

        build.mkdir(parents=True, exist_ok=True)
        lock = build / "lock"  # torch waits forever on the lock of a build that was killed; a build takes seconds
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            log.warning("removing the stale build lock %s (a build interrupted earlier)", lock)
            lock.unlink(missing_ok=True)
        load(name="mlc_decode_attention", sources=[str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
             build_directory=str(build), is_python_module=False, verbose=False)
        return torch.ops.mlc_kernels.decode_attention
    except Exception as e:  # no compiler, a read-only home, an unsupported platform: SDPA serves
        reason = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
        log.warning("the C++ decode-attention kernel is not available (%s); decode attention runs on torch SDPA. "
                    "Install a C++ compiler (g++) to build it, or set MLC_DECODE_KERNEL=0 to skip trying", reason)
        return None
