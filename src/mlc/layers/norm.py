"""RMSNorm in transformers' order: normalize in fp32, cast back, then scale by the weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlc.layers.cpu_kernels import cpu_op, eager_cpu


def _one_pass(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The C++ RMSNorm applies: 16-bit CPU tensors of one dtype, eager, nothing to differentiate."""
    return x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and eager_cpu(x, weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op, same math in fp32
        if _one_pass(x, self.weight):
            kernel = cpu_op("rms_norm")
            if kernel is not None:
                return kernel(x, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
