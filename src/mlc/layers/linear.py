"""Linear layers. `MergedLinear` stores several HF projections (q|k|v, gate|up) as one weight so a step runs one GEMM."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlc.errors import ModelFormatError


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Output rows are the concatenation of `shard_sizes`; each HF tensor loads into its own row range."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(shard_sizes), bias)
        self.shard_sizes = list(shard_sizes)
        self.offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]

    def load_shard(self, shard: int, name: str, tensor: torch.Tensor, is_bias: bool) -> None:
        target = self.bias if is_bias else self.weight
        if target is None:
            raise ModelFormatError(f"checkpoint has {name} but the config declares no bias for it")
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
