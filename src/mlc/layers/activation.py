"""Gated activations over fused projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mlc.layers.cpu_kernels import cpu_op, eager_cpu


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for a fused `[..., 2I]` projection whose first half is the gate (one C++ pass for
    16-bit CPU tensors; it rounds as the eager ops do, its exp may differ from torch's in the last bit of a float)."""
    if gate_up.dim() == 2 and gate_up.dtype in (torch.bfloat16, torch.float16) and eager_cpu(gate_up):
        op = cpu_op("silu_mul")
        if op is not None:
            return op(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
