"""Routed experts with quantized weights: one quantized layer per expert and projection, same routing arithmetic as
`mlc.layers.moe.RoutedExperts` (ascending expert order, weighted outputs cast to x's dtype before the sum)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mlc.layers.moe import RoutedExperts, dispatch_experts
from mlc.layers.quant_linear import QuantizedLinear

LayerFactory = Callable[[str, torch.Tensor, list[int] | None], QuantizedLinear]  # (projection, weight, shards)


class QuantizedExperts(nn.Module):
    def __init__(self, experts: RoutedExperts, make: LayerFactory):
        super().__init__()
        self.n_experts, self.total, self.first = experts.n_experts, experts.total, experts.first
        inter = experts.gate_up_proj.shape[1] // 2
        n = range(self.n_experts)
        self.gate_up = nn.ModuleList(make("gate_up_proj", experts.gate_up_proj[e], [inter, inter]) for e in n)
        self.down = nn.ModuleList(make("down_proj", experts.down_proj[e], None) for e in n)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return dispatch_experts(x, ids, weights, self.total, self._expert, self.first, self.n_experts)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up[e](x).chunk(2, dim=-1)
        return self.down[e](F.silu(gate) * up)

    def weight_bytes(self) -> int:
        return sum(m.weight_bytes() for m in (*self.gate_up, *self.down))
