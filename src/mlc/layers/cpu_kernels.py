"""The C++ CPU kernels (`csrc/`), one extension registering its ops under `torch.ops.mlc_kernels` (`csrc/ops.cpp`):

* decode attention (`decode_attention.cpp`): one query per sequence, attending over its context read in place
  through the page table, so a decode step skips the gather, the key padding and the masked SDPA; a sequence's
  result does not depend on its batch (each sequence and KV head is computed whole, in one order);
* the int4 and int8 GEMMs (`int4_linear.cpp`, `int8_linear.cpp`, `quant_gemm.h`; `layers/quant_linear.py`):
  activations as two int8 digits (about 16 bits), exact integer dot products, each row alone;
* the gguf GEMM on a GGUF's own blocks, every common type (`gguf_linear.cpp`, `gguf_blocks.h`, `gguf_pack.cpp`;
  `layers/gguf_linear.py`), the same arithmetic, and `gguf_rows`, the embedding lookup from the mapped file;
* `on_huge_pages` (`huge_pages.cpp`): packed weights on 2 MiB pages, where they stream about a quarter faster, laid
  end to end in shared mappings;
* RMSNorm, RoPE and SiLU x up for 16-bit models (`fused_ops.cpp`): one pass a row instead of several eager ops,
  with the eager ops' roundings;
* a Llama, GLM or GLM-4 decoder layer over a step of decode tokens (`decode_layer.cpp`; `models/fused_decode.py`):
  the ops above called in the eager layer's order from C++, one call a layer instead of forty.

`load()` builds the extension once per machine with torch's cpp_extension (the C++ compiler inductor uses too;
`-O3 -march=native`) into `$MLC_HOME/kernels/cpu_kernels-torch<version>-<cpu>-<sources>/`, and loads it from there
afterwards;
`cpu_op(name)` looks an op up. Without a compiler, or with `MLC_CPU_KERNELS=0` (the older name
`MLC_DECODE_KERNEL=0` is still read), the torch ops run instead: SDPA (`layers/attention.py`, as every non-CPU
device and every quantized KV cache does), torch's int4 kernel, the eager elementwise ops.
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
NAME = "mlc_cpu_kernels"  # the extension's build name; its ops are torch.ops.mlc_kernels.<op>
SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("ops.cpp", "decode_attention.cpp", "int4_linear.cpp", "int8_linear.cpp", "gguf_linear.cpp",
                        "gguf_pack.cpp", "huge_pages.cpp", "fused_ops.cpp", "decode_layer.cpp")]
ENV = ("MLC_CPU_KERNELS", "MLC_DECODE_KERNEL")  # 0/false/off/no turns the kernels off; the second is the older name
# no -ffast-math: the sums keep the order the source gives them (batch invariance needs a fixed order, not this one);
# no contraction of a * b + c into one fma unless the source asks, so the fused ops round as the eager ops do
FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-fopenmp"]
STALE_LOCK_S = 600
FAILED = "build-failed.json"  # a failed build's reason, beside the build, until its sources or compiler change
_LOCK = threading.Lock()
_LOADED: dict[str, object] = {}  # op name -> the op, or None without the kernels
_BUILT: list[bool] = []  # [whether the kernels loaded], once load() has run


def load() -> bool:
    """Build (first run on this machine) or load the C++ kernels, once a process; False when they cannot be (turned
    off, no compiler, a failed build), and torch's ops serve."""
    if not _BUILT:
        with _LOCK:
            if not _BUILT:
                _BUILT.append(_load())
    return _BUILT[0]


def cpu_op(name: str):
    """`torch.ops.mlc_kernels.<name>` (decode_attention, rms_norm, int4_linear, int8_linear, gguf_linear, gguf_pack,
    gguf_rows, on_huge_pages, rope_neox, silu_mul),
    loading the kernels on first call; None without them. Looked up once: layers call this on every step."""
    if name not in _LOADED:
        op = getattr(torch.ops.mlc_kernels, name) if load() else None
        if op is not None and name in _FAKES and not getattr(op.default, "_mlc_fake", False):
            torch.library.register_fake(f"mlc_kernels::{name}")(_FAKES[name])  # what torch.compile traces
            op.default._mlc_fake = True
        _LOADED[name] = op
    return _LOADED[name]


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """`t` copied onto 2 MiB pages (csrc/huge_pages.h: packed weights stream about a quarter faster there); `t`
    itself without the kernels."""
    op = cpu_op("on_huge_pages")
    return t if op is None or t.device.type != "cpu" else op(t)


def eager_cpu(*tensors: torch.Tensor) -> bool:
    """The fused elementwise kernels apply: CPU tensors, eager (not traced by torch.compile), nothing to
    differentiate (training keeps the eager ops, which autograd knows)."""
    return (all(t.device.type == "cpu" for t in tensors) and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


_FAKES = {"int4_linear": lambda x, packed, group: x.new_empty(x.shape[0], packed.shape[0] * 16),
          "int8_linear": lambda x, packed: x.new_empty(x.shape[0], packed.shape[0] * 16),
          "gguf_linear": lambda x, packed, kind: x.new_empty(x.shape[0], packed.shape[0] * 16),
          "gguf_rows": lambda raw, ids, kind, k: raw.new_empty(ids.numel(), k, dtype=torch.float32)}


def kernel_status() -> str:
    """For the startup log: which CPU kernels this process runs."""
    if not load():
        return "torch ops (SDPA decode attention, torch's int4 and fbgemm's int8 kernels, eager RMSNorm/RoPE/SiLU)"
    return "C++ kernels (paged decode attention, int4, int8 and GGUF-block GEMMs, RMSNorm, RoPE, SiLU x up)"


def _cpu_key() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = os.uname().machine
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def kernels_off() -> bool:
    """`MLC_CPU_KERNELS` (or, where that is unset or empty, the older `MLC_DECODE_KERNEL`) is 0, false, off or no."""
    value = next((os.environ[name] for name in ENV if os.environ.get(name, "").strip()), "1")
    return value.strip().lower() in ("0", "false", "off", "no")


def compiler() -> str | None:
    """The C++ compiler torch's cpp_extension would run (`$CXX`, else c++), as a path; None when there is none."""
    from torch.utils.cpp_extension import get_cxx_compiler

    return shutil.which(get_cxx_compiler())


def _build_dir() -> Path:
    from mlc.config.paths import mlc_home

    # MLC_KERNEL_MARCH: the -march to build for (default native); the tests build haswell (AVX2) and x86-64 (plain
    # C++) to check that every code path gives the native build's int4 results
    # and each version of the sources its own directory: two checkouts of different versions on one machine (a
    # worktree, CI beside a development tree) would otherwise rebuild over each other's library
    suffix = "" if _march() == "native" else f"-{_march()}"
    return mlc_home() / "kernels" / f"cpu_kernels-torch{torch.__version__}-{_cpu_key()}{suffix}-{_sources_key()}"


def _sources_key() -> str:
    digest = hashlib.sha256()
    for path in SOURCES + sorted((Path(__file__).parent / "csrc").glob("*.h")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:10]


def _march() -> str:
    return os.environ.get("MLC_KERNEL_MARCH", "native").strip() or "native"


def _attempt_key() -> str:
    """What a build attempt depends on: the sources, the flags and the compiler. A failure is remembered under it,
    so a fixed source or a newly installed compiler is tried again, and nothing else is."""
    return hashlib.sha256(f"{compiler()}|{_march()}|{FLAGS}|{_sources_key()}".encode()).hexdigest()[:16]


def build_failure() -> str | None:
    """Why the last build on this machine failed, while nothing it depends on has changed; None if it did not."""
    marker = _build_dir() / FAILED
    try:
        record = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return record.get("reason") if record.get("key") == _attempt_key() else None


def _load() -> bool:
    if kernels_off():
        return False
    if hasattr(torch.ops.mlc_kernels, "decode_attention"):  # another engine in this process loaded them
        return True
    return _build()


def _build() -> bool:
    """Build (or load the earlier build of) the kernels into $MLC_HOME/kernels; False, remembered, when it fails."""
    build = _build_dir()
    failed = build_failure()
    if failed is not None:  # every process and tensor-parallel worker would fail the same way: say it, don't retry
        log.warning("the C++ CPU kernels failed to build on this machine earlier (%s); torch's ops run instead "
                    "(slower). Delete %s to try again", failed, build / FAILED)
        return False
    try:
        from torch.utils.cpp_extension import load

        build.mkdir(parents=True, exist_ok=True)
        lock = build / "lock"  # torch waits forever on the lock of a build that was killed; a build takes seconds
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            log.warning("removing the stale build lock %s (a build interrupted earlier)", lock)
            lock.unlink(missing_ok=True)
        load(name=NAME, sources=[str(p) for p in SOURCES],
             extra_cflags=[f"-march={_march()}", *FLAGS], extra_ldflags=["-fopenmp"], build_directory=str(build),
             is_python_module=False, verbose=False)
        return True
    except Exception as e:  # no compiler, a read-only home, an unsupported platform: SDPA serves
        lines = str(e).strip().splitlines() or [type(e).__name__]
        reason = next((ln.strip() for ln in lines if "error:" in ln), lines[-1])[:300]  # a compiler's first error
        _remember_failure(build, reason)
        log.warning("the C++ CPU kernels are not available (%s); torch's ops run instead (slower). "
                    "Without a C++ compiler, install one (g++); MLC_CPU_KERNELS=0 skips trying", reason)
        return False


def _remember_failure(build: Path, reason: str) -> None:
    try:
        build.mkdir(parents=True, exist_ok=True)
        (build / FAILED).write_text(json.dumps({"key": _attempt_key(), "reason": reason}))
    except OSError:
        pass  # a read-only home: every process tries (and fails) on its own
