"""Can this model run at this tensor-parallel size on these devices? Answered from config.json alone, before any
worker process starts, with one message that says what to change."""

from __future__ import annotations

import os

import torch

from mlc.config.device import npu_available, resolve_device
from mlc.errors import ConfigError, DeviceError


def backend_for(device: torch.device) -> str:
    """torch.distributed's backend for a device type: gloo on CPU, nccl on CUDA, hccl on Ascend NPUs."""
    return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[device.type]


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:r / npu:r (one accelerator per rank), the CPU for every rank on a CPU."""
    return device if device.type == "cpu" else torch.device(device.type, rank)


def devices_available(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.device_count()
    if device.type == "npu" and npu_available():
        return torch.npu.device_count()  # type: ignore[attr-defined]
    return os.cpu_count() or 1  # on a CPU each rank needs a core of its own to gain anything


def _unsplittable(cfg, size: int, expert_parallel: bool) -> list[tuple[str, int]]:
    """(what, count) of every dimension tensor parallelism splits that `size` ranks cannot share evenly."""
    bad = [(what, n) for what, n in (("vocabulary size", cfg.vocab_size),
                                     ("number of attention heads", cfg.num_attention_heads),
                                     ("MLP intermediate size", getattr(cfg, "intermediate_size", None) or 0))
           if n % size]
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if getattr(cfg, "kv_lora_rank", None) is None and (kv % size if kv >= size else size % kv):
        bad.append(("number of KV heads", kv))  # fewer KV heads than ranks: each rank's queries need one whole
    experts = getattr(cfg, "n_routed_experts", None)
    if experts:
        shared = cfg.moe_intermediate_size * (getattr(cfg, "n_shared_experts", 0) or 0)
        if expert_parallel and experts % size:
            bad.append(("number of routed experts", experts))
        if expert_parallel and shared % size:
            bad.append(("shared experts' intermediate size", shared))
        if not expert_parallel and cfg.moe_intermediate_size % size:
            bad.append(("MoE intermediate size (or add --enable-expert-parallel)", cfg.moe_intermediate_size))
    return bad


def check_tensor_parallel(cfg, size: int, expert_parallel: bool, device: str) -> None:
    """Raise ConfigError / DeviceError unless `cfg` shards evenly over `size` ranks on `device`."""
    check_shardable(cfg, size, expert_parallel)
    if size == 1:
        return
    dev = resolve_device(device)
    have = devices_available(dev)
    if size > have:
        unit = "CPU cores" if dev.type == "cpu" else f"{dev.type} devices"
        raise DeviceError(f"tensor parallel size {size} is larger than the {have} {unit} available; "
                          f"use --tensor-parallel-size {have} or less")


def check_shardable(cfg, size: int, expert_parallel: bool, most: int = 16) -> None:
    """Raise ConfigError unless every dimension tensor parallelism splits divides by `size` (config only)."""
    if size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {size}")
    if expert_parallel and not getattr(cfg, "n_routed_experts", None):
        raise ConfigError(f"--enable-expert-parallel needs a mixture-of-experts model; {cfg.model_type} has no routed "
                          "experts (drop the flag)")
    if size == 1:
        return
    bad = _unsplittable(cfg, size, expert_parallel)
    if bad:
        shown = ", ".join(f"{what} {n}" for what, n in bad)
        ok = [1] + [n for n in range(2, most + 1) if not _unsplittable(cfg, n, expert_parallel)]
        raise ConfigError(f"tensor parallel size {size} does not divide this model's {shown}; sizes that fit "
                          f"this model (up to {most}): {', '.join(map(str, ok))}")


def fits_tensor_parallel(cfg, size: int) -> bool:
    """Whether the engine can shard `cfg` over `size` ranks (with experts split, or spread for a MoE model)."""
    modes = (False, True) if getattr(cfg, "n_routed_experts", None) else (False,)
    return any(not _unsplittable(cfg, size, ep) for ep in modes)


def check_pipeline_parallel(cfg, stages: int, device: str, local: bool = True, tp: int = 1,
                            expert_parallel: bool = False) -> None:
    """Raise ConfigError / DeviceError unless `cfg`'s layers make `stages` stages of `tp` tensor-parallel ranks, one
    process (and device) each (of this machine's, when they are `local`)."""
    layers = int(cfg.num_hidden_layers)
    if stages > layers:
        raise ConfigError(f"pipeline_parallel_size {stages} is more than the model's {layers} layers; use "
                          f"--pipeline-parallel-size {layers} or less")
    check_shardable(cfg, tp, expert_parallel)
    if not local:
        return  # the launcher's placement holds a device (or cores) for each process, wherever it is
    dev = resolve_device(device)
    have = devices_available(dev)
    if stages * tp > have:
        unit = "CPU cores" if dev.type == "cpu" else f"{dev.type} devices"
        what = f"pipeline parallel size {stages}" + (f" x tensor parallel size {tp}" if tp > 1 else "")
        raise DeviceError(f"{what} is larger than the {have} {unit} available; use fewer stages or ranks (at most "
                          f"{have} processes)")
