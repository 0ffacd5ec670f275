"""Gated activations over fused projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for a fused `[..., 2I]` projection whose first half is the gate."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
