"""The SwiGLU feed-forward block shared by Llama, GLM and the MoE shared experts."""

from __future__ import annotations

import torch
from torch import nn

from mlc.distributed.state import reduce_from_tp
from mlc.layers.activation import silu_and_mul
from mlc.layers.linear import Linear, MergedLinear


class GatedMLP(nn.Module):
    """`down(silu(gate x) * up x)` with gate and up fused into one GEMM (`gate_up_proj`, gate rows first)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, reduce: bool = True):
        super().__init__()
        what = "MLP intermediate size"
        self.gate_up_proj = MergedLinear(hidden, [intermediate, intermediate], bias=bias, what=what)
        self.down_proj = Linear(intermediate, hidden, bias=bias, parallel="row", what=what)
        self.reduce = reduce  # False: the caller sums this partial output with others first (MoE shared experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        return reduce_from_tp(y) if self.reduce else y
