"""Process group set-up for `--nproc N` (torchrun sets RANK/WORLD_SIZE), and the launcher that starts it."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlc.errors import TrainingError

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    tp: int = 1  # ranks per copy of the model (tensor parallel); the data is split over world_size // tp copies

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        return self.rank // self.tp

    @property
    def data_world(self) -> int:
        return self.world_size // self.tp

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_distributed(device: torch.device, tp: int = 1) -> DistInfo:
    if not launched_by_torchrun():
        return DistInfo()
    info = DistInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)), tp)
    if info.world_size % tp:
        raise TrainingError(f"{info.world_size} processes cannot hold copies of the model split {tp} ways")
    if not dist.is_initialized():
        dist.init_process_group(backend=BACKENDS[device.type])
    return info


def device_for_rank(device: torch.device, info: DistInfo) -> torch.device:
    """Accelerators: one device per local rank; the CPU is shared."""
    if device.type == "cpu" or not info.enabled:
        return device
    return torch.device(device.type, info.local_rank)


def all_reduce_sum(value: torch.Tensor, info: DistInfo, per_copy: bool = True) -> torch.Tensor:
    """Sum over the copies of the model (`per_copy`: the ranks of one tensor-parallel copy hold the same value,
    counted once), or over every rank."""
    if info.enabled:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        if per_copy and info.tp > 1:
            value /= info.tp
    return value


def data_parallel(model: torch.nn.Module, device: torch.device, group) -> torch.nn.Module:
    """`model` wrapped for data parallelism over `group`. Its buffers (rotary tables, a qlora base's 4-bit weights)
    are the same on every rank, so they are not re-sent at each forward (torch 2.13 renamed broadcast_buffers)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type != "cpu" else None
    renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    no_resend = "forward_sync_buffers" if renamed else "broadcast_buffers"
    flags: dict = {no_resend: False}
    return DistributedDataParallel(model, device_ids=ids, process_group=group, **flags)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def launch(nproc: int, cli_args: list[str]) -> None:
    """Re-run `mlc-cli <cli_args>` under torchrun with `nproc` workers on this machine."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        "-m", "mlc.cli.main", *cli_args,
    ]
    env = dict(os.environ)
    # Each worker gets an equal share of the cores instead of all of them fighting for every core.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    code = subprocess.call(cmd, env=env)
    if code != 0:
        raise TrainingError(f"a training worker failed (torchrun exit code {code}); its error is printed above")
