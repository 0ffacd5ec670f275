"""Linear layers. `MergedLinear` stores several HF projections (q|k|v, gate|up) as one weight so a step runs one GEMM.

Under tensor parallelism (`mlc.distributed`) a layer built with `parallel="col"` holds this rank's slice of the
output rows (column-parallel: each rank computes its own output features), and `parallel="row"` its slice of the
input columns (row-parallel: each rank computes a partial sum that the caller reduces with `reduce_from_tp`; the
bias is loaded on rank 0 only so that the sum holds it once). Checkpoints keep their full shapes: the layer's
`Sharding` cuts each tensor to this rank's part as it loads (and LoRA pairs the same way), so the same files serve
any tensor-parallel size. Quantized stand-ins keep the `Sharding` of the layer they replace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mlc.distributed.state import tp_rank, tp_size
from mlc.errors import ConfigError, ModelFormatError


def split_evenly(total: int, what: str, parts: int | None = None) -> int:
    """This rank's share of `total` (heads, features, vocabulary rows); an error if the ranks cannot share it."""
    parts = tp_size() if parts is None else parts
    if total % parts:
        raise ConfigError(f"tensor parallel size {parts} does not divide the model's {what} ({total}); "
                          f"use a tensor parallel size that divides {total}")
    return total // parts


@dataclass
class Sharding:
    """Which part of a full layer this rank holds. "col": `rows[i]` = (start, size) of shard i's rows in its full
    HF tensor (one shard for a plain layer); "row": `cols` = (start, size) of the input columns."""

    mode: str
    full_shards: list[int]
    rows: list[tuple[int, int]] | None = None
    cols: tuple[int, int] | None = None

    def shard(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """Rows of shard i from its full tensor (weight or bias); other shapes pass (the shape check reports them)."""
        if self.mode != "col" or t.shape[0] != self.full_shards[i]:
            return t
        assert self.rows is not None  # a "col" sharding carries its rows
        start, size = self.rows[i]
        return t[start : start + size]

    def cut(self, attr: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full checkpoint tensor of `attr` ("weight" or "bias")."""
        if self.mode == "col":
            if t.shape[0] != sum(self.full_shards):
                return t
            return torch.cat([self.shard(i, p) for i, p in enumerate(t.split(self.full_shards, dim=0))])
        if attr == "bias":
            return t if tp_rank() == 0 else torch.zeros_like(t)  # the reduced sum adds rank 0's bias once
        assert self.cols is not None  # a "row" sharding carries its columns
        start, size = self.cols
        return t[:, start : start + size] if t.dim() == 2 and t.shape[1] == size * tp_size() else t

    def lora(self, shard: int | None, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A LoRA pair `a [r, in]`, `b [out, r]` cut like this layer (rows of b, or columns of a)."""
        if self.mode == "col":
            return a, (self.cut("weight", b) if shard is None else self.shard(shard, b))
        return self.cut("weight", a), b


class Linear(nn.Module):
    """`parallel`: None (replicated), "col" (output rows split) or "row" (input columns split, partial output)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, parallel: str | None = None,
                 what: str = "projection width"):
        super().__init__()
        self.tp: Sharding | None = None
        if tp_size() > 1 and parallel == "col":
            size = split_evenly(out_features, what)
            self.tp = Sharding("col", [out_features], rows=[(tp_rank() * size, size)])
            out_features = size
        elif tp_size() > 1 and parallel == "row":
            size = split_evenly(in_features, what)
            self.tp = Sharding("row", [out_features], cols=(tp_rank() * size, size))
            in_features = size
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def tp_slice(self, attr: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.tp is None else self.tp.cut(attr, tensor)


class MergedLinear(Linear):
    """Output rows are the concatenation of `shard_sizes`; each HF tensor loads into its own row range.

    Column-parallel under tensor parallelism: each shard keeps this rank's rows, an even split unless `local` gives
    (start, size) per shard (KV heads fewer than ranks: each rank keeps the whole KV head its queries read)."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False, what: str = "projection width",
                 local: list[tuple[int, int]] | None = None):
        super().__init__(in_features, sum(shard_sizes), bias)
        if tp_size() > 1:
            if local is None:
                sizes = [split_evenly(s, what) for s in shard_sizes]
                local = [(tp_rank() * s, s) for s in sizes]
            self.tp = Sharding("col", list(shard_sizes), rows=local)
            shard_sizes = [s for _, s in local]
            self.out_features = sum(shard_sizes)
            self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)
            self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        self.shard_sizes = list(shard_sizes)
        self.offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]

    def load_shard(self, shard: int, name: str, tensor: torch.Tensor, is_bias: bool) -> None:
        target = self.bias if is_bias else self.weight
        if target is None:
            raise ModelFormatError(f"checkpoint has {name} but the config declares no bias for it")
        if self.tp is not None:
            tensor = self.tp.shard(shard, tensor)
        start, size = self.offsets[shard], self.shard_sizes[shard]
        expected = (size,) if is_bias else (size, self.in_features)
        if tuple(tensor.shape) != expected:
            raise ModelFormatError(
                f"{name}: shape {tuple(tensor.shape)} does not match the config ({expected}); "
                "the checkpoint and its config.json disagree"
            )
        target.data[start : start + size].copy_(tensor)

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        return list(y.split(self.shard_sizes, dim=-1))
