"""Doctor checks of this host: Python and package versions, CPU features, CUDA, memory, disk, offline mode, port."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

from mlc.doctor.check import Check

MIN_PYTHON = (3, 10)
MIN_TORCH = (2, 4)
MIN_TRANSFORMERS = (5, 2)
GIB = 2**30


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_python() -> Check:
    v = sys.version_info
    if (v.major, v.minor) < MIN_PYTHON:
        return Check("python", "fail", f"Python {v.major}.{v.minor} is older than 3.10", "install Python 3.10 or newer")
    return Check("python", "ok", f"Python {v.major}.{v.minor}.{v.micro} ({sys.executable})")


def check_packages() -> Check:
    try:
        import torch
        import transformers
    except ImportError as e:
        return Check("packages", "fail", f"cannot import {e.name}", "pip install -e '.[dev]' (or `make setup`)")
    problems = []
    if _version_tuple(torch.__version__) < MIN_TORCH:
        problems.append(f"torch {torch.__version__} < 2.4")
    if _version_tuple(transformers.__version__) < MIN_TRANSFORMERS:
        problems.append(f"transformers {transformers.__version__} < 5.2")
    detail = f"torch {torch.__version__}, transformers {transformers.__version__}"
    if problems:
        return Check("packages", "fail", f"{detail}: {'; '.join(problems)}",
                     "pip install -U 'torch>=2.4' 'transformers>=5.2'")
    return Check("packages", "ok", detail)


def check_cpu() -> Check:
    from mlc.config.hardware import detect_cpu

    cpu = detect_cpu()
    flags = ", ".join(cpu.cpu_flags) or "no AVX flags"
    if not cpu.has_bf16_units:
        return Check("cpu", "warn", f"{cpu.description}; {flags}; no bf16 units",
                     "serve and train in fp32 on this CPU (the default: dtype auto); bf16 is emulated and slower")
    return Check("cpu", "ok", f"{cpu.description}; {flags}")


def check_cuda() -> Check:
    import torch

    if not torch.cuda.is_available():
        built = torch.version.cuda
        detail = "torch has no CUDA build" if built is None else f"torch built for CUDA {built} but sees no GPU"
        return Check("cuda", "skip", f"{detail}; the engine runs on the CPU",
                     "" if built is None else "check `nvidia-smi` and CUDA_VISIBLE_DEVICES")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return Check("cuda", "ok", f"{len(names)} GPU(s): {', '.join(names)} (CUDA {torch.version.cuda})")


def check_memory(mem: dict[str, int] | None = None) -> Check:
    from mlc.config.hardware import meminfo

    mem = mem if mem is not None else meminfo()
    avail = mem.get("MemAvailable")
    if avail is None:
        return Check("memory", "skip", "cannot read /proc/meminfo")
    detail = f"{avail / GIB:.1f} GiB available of {mem.get('MemTotal', 0) / GIB:.1f} GiB"
    if avail < 1 * GIB:
        return Check("memory", "fail", detail, "free memory: the default model with its KV cache needs about 1 GiB")
    if avail < 4 * GIB:
        return Check("memory", "warn", detail, "lower --kv-cache-memory or --max-batch-size, or free memory")
    return Check("memory", "ok", detail)


def check_disk(path: Path | None = None) -> Check:
    from mlc.config.paths import mlc_home

    path = Path(path or mlc_home())
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    detail = f"{free / GIB:.1f} GiB free at {probe} (model store {path})"
    if free < 1 * GIB:
        return Check("disk", "fail", detail, "free disk space or set MLC_HOME to a larger volume")
    if free < 10 * GIB:
        return Check("disk", "warn", detail, "GLM checkpoints need 20-1500 GB; set MLC_HOME to a larger volume")
    return Check("disk", "ok", detail)


def check_hf_offline(env: dict[str, str] | None = None) -> Check:
    env = dict(os.environ) if env is None else env
    value = env.get("HF_HUB_OFFLINE", "")
    if value.lower() in ("1", "true", "yes", "on"):
        return Check("hf offline", "ok", f"HF_HUB_OFFLINE={value}")
    return Check("hf offline", "warn", "HF_HUB_OFFLINE is not set: transformers may try the network and stall on "
                 "air-gapped hosts",
                 "export HF_HUB_OFFLINE=1 (mlc reads models from its store and never needs the hub)")


def check_port(port: int, host: str = "127.0.0.1", required: bool = False) -> Check:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            status = "fail" if required else "warn"
            return Check("port", status, f"{host}:{port} is in use ({e.strerror})",
                         f"stop the process on it (`ss -ltnp | grep :{port}`) or serve with --port {port + 1}")
    return Check("port", "ok", f"{host}:{port} is free")
