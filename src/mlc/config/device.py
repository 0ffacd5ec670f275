"""Device and compute-dtype selection (cpu by default; cuda, or npu through torch_npu, where present)."""

from __future__ import annotations

import functools
import importlib.util

import torch

from mlc.errors import DeviceError

DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
}


def npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers the "npu" device)

    # torch_npu adds torch.npu; torch's stubs lack it
    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


def resolve_device(device: str | torch.device | None = "cpu") -> torch.device:
    name = str(device or "cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "npu" if npu_available() else "cpu"
    kind = name.split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        raise DeviceError(
            "device 'cuda' was asked for but torch sees no CUDA GPU; use --device cpu or run `mlc-cli doctor`")
    if kind == "npu" and not npu_available():
        raise DeviceError(
            "device 'npu' needs torch_npu and a visible Ascend NPU; use --device cpu or run `mlc-cli doctor`")
    if kind not in ("cpu", "cuda", "npu"):
        raise DeviceError(f"unknown device {name!r}; use cpu, cuda, cuda:N, npu or auto")
    return torch.device(name)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device, config_dtype=None) -> torch.dtype:
    """fp32 on CPU unless asked otherwise (this CPU class has no fast bf16 matmul); the checkpoint's dtype elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cpu":
            return torch.float32
        if isinstance(config_dtype, torch.dtype) and config_dtype.is_floating_point:
            return config_dtype
        return DTYPES.get(str(config_dtype).replace("torch.", ""), torch.bfloat16)
    if dtype not in DTYPES:
        raise DeviceError(f"unknown dtype {dtype!r}; use one of auto, fp32, fp16, bf16")
    return DTYPES[dtype]


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 arithmetic runs in hardware (else it is emulated, slower than fp32)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags))
