"""This process's place in a tensor-parallel group, and the collectives the sharded layers call.

Layers read the group when they are built (`tp_rank()`, `tp_size()`), so the same model classes build a whole
model in a lone process and one shard of it in a rank of a group. Outside a group every collective is a no-op and
no torch.distributed code runs.

The collectives are autograd-aware (Megatron's f/g pair), so a sharded model also trains:
`reduce_from_tp` sums partial outputs forward and passes gradients through; `copy_to_tp` is the identity forward
and sums the gradients of the replicated input backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class ParallelState:
    rank: int = 0
    size: int = 1
    expert_parallel: bool = False  # MoE experts spread over the ranks instead of split inside each expert
    group: object | None = None  # a torch.distributed ProcessGroup; None = the default group


_STATE = ParallelState()


def set_parallel_state(rank: int, size: int, expert_parallel: bool = False, group=None) -> None:
    global _STATE
    _STATE = ParallelState(rank, size, expert_parallel, group)


def reset_parallel_state() -> None:
    set_parallel_state(0, 1)


SINGLE = ParallelState()  # a whole model in a lone process


@contextmanager
def parallel_scope(state: ParallelState) -> Iterator[None]:
    """Run a block as `state`'s rank: a process may hold a tensor-parallel engine (the driver, rank 0 of its group)
    and whole-model engines side by side, and each must build and run under its own state, not the last one set."""
    global _STATE
    saved, _STATE = _STATE, state
    try:
        yield
    finally:
        _STATE = saved


def parallel_state() -> ParallelState:
    return _STATE


def tp_rank() -> int:
    return _STATE.rank


def tp_size() -> int:
    return _STATE.size


def ep_enabled() -> bool:
    return _STATE.expert_parallel and _STATE.size > 1


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    x = x.contiguous()
    dist.all_reduce(x, group=_STATE.group)
    return x


def _all_gather_last(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(_STATE.size)]
    dist.all_gather(parts, x.contiguous(), group=_STATE.group)
    return torch.cat(parts, dim=-1)


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x.clone())

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone())


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.width = x.shape[-1]
        return _all_gather_last(x)

    @staticmethod
    def backward(ctx, grad):
        w = ctx.width
        return grad[..., tp_rank() * w : (tp_rank() + 1) * w].contiguous()


def _tracks_grad(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


def reduce_from_tp(x: torch.Tensor) -> torch.Tensor:
    """Sum the ranks' partial `x` (row-parallel outputs, vocabulary-parallel lookups, expert partial sums)."""
    if _STATE.size == 1:
        return x
    return _Reduce.apply(x) if _tracks_grad(x) else _all_reduce(x)


def copy_to_tp(x: torch.Tensor) -> torch.Tensor:
    """Mark a replicated input entering column-parallel layers (gradients from every rank are summed)."""
    if _STATE.size == 1 or not _tracks_grad(x):
        return x
    return _Copy.apply(x)


def gather_from_tp(x: torch.Tensor) -> torch.Tensor:
    """Concatenate the ranks' slices of the last dimension (vocabulary-parallel logits)."""
    if _STATE.size == 1:
        return x
    return _Gather.apply(x) if _tracks_grad(x) else _all_gather_last(x)
