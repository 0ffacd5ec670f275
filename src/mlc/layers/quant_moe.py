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
    """Experts `first`..`first + len(down)` of `total`: expert e runs `down[e](silu(gate) * up)` of `gate_up[e](x)`."""

    def __init__(self, gate_up: list[QuantizedLinear], down: list[QuantizedLinear], total: int, first: int = 0):
        super().__init__()
        self.n_experts, self.total, self.first = len(down), total, first
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)

    @classmethod
    def of(cls, experts: RoutedExperts, make: LayerFactory) -> QuantizedExperts:
        """Each of `experts`' float weights quantized by `make`."""
        inter = experts.gate_up_proj.shape[1] // 2
        n = range(experts.n_experts)
        return cls([make("gate_up_proj", experts.gate_up_proj[e], [inter, inter]) for e in n],
                   [make("down_proj", experts.down_proj[e], None) for e in n], experts.total, experts.first)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return dispatch_experts(x, ids, weights, self.total, self._expert, self.first, self.n_experts)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up[e](x).chunk(2, dim=-1)
        return self.down[e](F.silu(gate) * up)

    def weight_bytes(self) -> int:
        return sum(m.weight_bytes() for m in (*self.gate_up, *self.down))
