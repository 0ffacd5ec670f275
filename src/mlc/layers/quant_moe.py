"""Routed experts with quantized weights: one quantized layer per expert and projection, same routing arithmetic as
`mlc.layers.moe.RoutedExperts` (ascending expert order, weighted outputs cast to x's dtype before the sum)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mlc.layers.moe import RoutedExperts
from mlc.layers.quant_linear import QuantizedLinear

LayerFactory = Callable[[str, torch.Tensor, list[int] | None], QuantizedLinear]  # (projection, weight, shards)


class QuantizedExperts(nn.Module):
    def __init__(self, experts: RoutedExperts, make: LayerFactory):
        super().__init__()
        self.n_experts = experts.n_experts
        inter = experts.gate_up_proj.shape[1] // 2
        n = range(self.n_experts)
        self.gate_up = nn.ModuleList(make("gate_up_proj", experts.gate_up_proj[e], [inter, inter]) for e in n)
        self.down = nn.ModuleList(make("down_proj", experts.down_proj[e], None) for e in n)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        top_k = ids.shape[1]
        order = ids.flatten().argsort(stable=True)
        counts = torch.bincount(ids.flatten(), minlength=self.n_experts).tolist()
        flat_weights = weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            picks = order[start : start + count]
            start += count
            tokens = picks // top_k
            gate, up = self.gate_up[expert](x[tokens]).chunk(2, dim=-1)
            y = self.down[expert](F.silu(gate) * up) * flat_weights[picks, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out

    def weight_bytes(self) -> int:
        return sum(m.weight_bytes() for m in (*self.gate_up, *self.down))
