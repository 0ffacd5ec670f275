"""Hardware profiles: accelerators as YAML data (`config/profiles/*.yaml`), the host CPU detected at run time."""

from __future__ import annotations

import os
import platform
import time
from functools import lru_cache
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mlc.config.engine_config import parse_size
from mlc.errors import ConfigError

PROFILE_DIR = Path(__file__).parent / "profiles"

# FLOPs per cycle per core, by the widest unit the flags show (2 FMA ports assumed; an estimate, not a spec).
_FP32_FLOPS_PER_CYCLE = {"avx512f": 64, "avx2": 32, "": 8}
_BF16_FLOPS_PER_CYCLE = {"amx_bf16": 1024, "avx512_bf16": 128}


class HardwareProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = ""
    vendor: Literal["nvidia", "ascend", "cpu", "other"]
    device: Literal["cpu", "cuda", "npu"]
    memory: int = Field(gt=0)  # bytes per device
    memory_bandwidth_gbps: float = Field(gt=0)  # GB/s per device
    peak_dense_tflops: dict[str, float]
    alignment: int = Field(1, ge=1)  # preferred multiple for tensor dims and LoRA ranks, in elements
    compute_dtypes: list[str]
    weight_dtypes: list[str]
    kv_cache_dtypes: list[str]
    preferred_dtype: str
    bf16_native: bool | None = None  # None -> "bf16" in compute_dtypes
    devices_per_node: int = Field(1, ge=1)
    interconnect_gbps: float | None = None
    constraints: list[str] = []
    uncertain: dict[str, str] = {}
    sources: list[str] = []
    cpu_flags: list[str] = []
    measured: dict[str, float] = {}

    @field_validator("memory", mode="before")
    @classmethod
    def _size(cls, v):
        return parse_size(v)

    @property
    def has_bf16_units(self) -> bool:
        return self.bf16_native if self.bf16_native is not None else "bf16" in self.compute_dtypes

    def tflops(self, dtype: str) -> float:
        """Peak dense TFLOPs for a compute dtype; quantized weights compute in the activation dtype."""
        table = self.peak_dense_tflops
        return table.get(dtype) or table.get(self.preferred_dtype) or max(table.values())


def profile_names() -> list[str]:
    return sorted(["cpu"] + [p.stem for p in PROFILE_DIR.glob("*.yaml")])


def load_profile(name_or_path: str | Path, measure: bool = False) -> HardwareProfile:
    """A built-in profile by name (`ascend-910b`), `cpu` (this host, detected) or a path to a profile YAML."""
    text = str(name_or_path)
    if text == "cpu":
        return detect_cpu(measure=measure)
    path = Path(text).expanduser()
    if not path.suffix:
        path = PROFILE_DIR / f"{text}.yaml"
    if not path.is_file():
        raise ConfigError(
            f"unknown hardware profile {text!r} (allowed: {', '.join(profile_names())}, or a profile .yaml path)")
    return _parse_profile(path)


@lru_cache(maxsize=16)
def _parse_profile(path: Path) -> HardwareProfile:
    try:
        data = yaml.safe_load(path.read_text()) or {}
        return HardwareProfile(**data)
    except (yaml.YAMLError, ValidationError, TypeError) as e:
        raise ConfigError(f"{path}: not a valid hardware profile: {e}") from None


def _cpuinfo() -> dict[str, str]:
    """The first processor block of /proc/cpuinfo (empty off Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    info: dict[str, str] = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        info[key.strip()] = value.strip()
    return info


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (empty off Linux)."""
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            parts = value.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return out


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def measure_memory_bandwidth(mib: int = 64, repeats: int = 5) -> float:
    """GB/s of a large tensor copy (read + write), best of `repeats`; about 0.1 s."""
    import torch

    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best / 1e9


def _widest(flags: set[str], table: dict[str, int]) -> int:
    return next((v for k, v in table.items() if k in flags or k == ""), 0)


def detect_cpu(measure: bool = False) -> HardwareProfile:
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    cores = usable_cores()
    ghz = float(info.get("cpu MHz", 2000.0) or 2000.0) / 1000
    fp32 = cores * ghz * _widest(flags, _FP32_FLOPS_PER_CYCLE) / 1000
    bf16_units = bool(flags & {"avx512_bf16", "amx_bf16"})
    bf16 = cores * ghz * _widest(flags, _BF16_FLOPS_PER_CYCLE) / 1000 if bf16_units else fp32
    memory = meminfo().get("MemTotal") or 8 * 2**30
    measured: dict[str, float] = {}
    bandwidth = min(10.0 * cores, 200.0)
    uncertain = {
        "peak_dense_tflops": "cores x clock x FLOPs/cycle of the widest vector unit; an estimate, not a measurement",
    }
    if measure:
        bandwidth = measured["memory_bandwidth_gbps"] = round(measure_memory_bandwidth(), 1)
    else:
        uncertain["memory_bandwidth_gbps"] = "estimate of 10 GB/s per core; plan measures it with a 64 MiB copy"
    shown = sorted(flags & {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "fma"})
    return HardwareProfile(
        name="cpu",
        description=f"{info.get('model name', platform.processor() or 'CPU')} ({cores} usable cores)",
        vendor="cpu",
        device="cpu",
        memory=memory,
        memory_bandwidth_gbps=bandwidth,
        peak_dense_tflops={"fp32": round(fp32, 3), "bf16": round(bf16, 3), "fp16": round(fp32, 3)},
        alignment=16 if "avx512f" in flags else 8,
        compute_dtypes=["fp32", "fp16", "bf16"],
        weight_dtypes=["fp32", "fp16", "bf16", "int8", "int4"],
        kv_cache_dtypes=["fp32", "fp16", "bf16", "int8", "int4"],
        preferred_dtype="fp32",
        bf16_native=bf16_units,
        devices_per_node=1,
        constraints=[] if bf16_units else ["no AVX512-BF16/AMX: bf16 matmuls are emulated and slower than fp32"],
        uncertain=uncertain,
        sources=["/proc/cpuinfo", "/proc/meminfo", "sched_getaffinity"],
        cpu_flags=shown,
        measured=measured,
    )
