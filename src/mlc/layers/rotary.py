"""Rotary position embeddings: the cos/sin tables and the three conventions the supported models use.

Tables follow transformers: `inv_freq` in fp32, `freqs = position * inv_freq` in fp32, `emb = cat(freqs, freqs)`,
then cos/sin scaled by the rope type's attention factor and cast to the activation dtype before use.
"""

from __future__ import annotations

import torch
from torch import nn

from mlc.errors import ModelFormatError
from mlc.layers.cpu_kernels import cpu_op, eager_cpu

# Rope types whose frequencies do not depend on the sequence length (those we can table once).
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn", "longrope"}


def rope_parameters(hf_config) -> dict:
    """The rope dict of a config, in the transformers v5 form (`rope_parameters`), with v4 fallbacks."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    return params


class RotaryEmbedding(nn.Module):
    """Computes (cos, sin) of shape `[T, rot_dim]` for flat positions `[T]`; tables grow on demand."""

    inv_freq: torch.Tensor  # a buffer, declared for the type checker

    def __init__(self, hf_config, rot_dim: int, device: torch.device | str | None = None):
        super().__init__()
        params = rope_parameters(hf_config)
        rope_type = params["rope_type"]
        if rope_type not in STATIC_ROPE_TYPES:
            raise ModelFormatError(
                f"rope_type {rope_type!r} is not supported (supported: {sorted(STATIC_ROPE_TYPES)}); "
                "edit rope_parameters in config.json or use a checkpoint with a static rope"
            )
        if rope_type == "default":
            base = float(params["rope_theta"])
            exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64).to(dtype=torch.float) / rot_dim
            inv_freq, self.attention_scaling = 1.0 / (base**exponents), 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        self.rot_dim = rot_dim
        # device None: the ambient default device (so the model can be built on "meta" to count its parameters)
        self.register_buffer("inv_freq", inv_freq.float().to(device or torch.get_default_device()), persistent=False)
        self._cos = torch.empty(0, rot_dim, device=device)
        self._sin = torch.empty(0, rot_dim, device=device)
        self._dtype: torch.dtype | None = None

    def _grow(self, n: int, dtype: torch.dtype) -> None:
        n = max(n, 2 * self._cos.shape[0], 256)
        pos = torch.arange(n, device=self.inv_freq.device, dtype=torch.float)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = (emb.cos() * self.attention_scaling).to(dtype)
        self._sin = (emb.sin() * self.attention_scaling).to(dtype)
        self._dtype = dtype

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(positions.max()) + 1 if positions.numel() else 1
        if need > self._cos.shape[0] or dtype != self._dtype:
            self._grow(need, dtype)
        return self._cos[positions], self._sin[positions]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_neox_fused(qkv: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor):
    """`apply_rope_neox` over the first `heads` heads of a fused `[T, width]` projection, as `[T, heads, head_dim]`:
    one C++ pass on the CPU (the same roundings), else the eager ops."""
    if cos.shape[-1] == head_dim and qkv.stride(-1) == 1 and cos.dtype == qkv.dtype and eager_cpu(qkv, cos, sin):
        op = cpu_op("rope_neox")
        if op is not None:
            return op(qkv, cos, sin, heads, head_dim)
    return apply_rope_neox(qkv[:, : heads * head_dim].view(qkv.shape[0], heads, head_dim), cos, sin)


def apply_rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Convention (A), half-split (Llama, glm4_moe): rotates the first `rot_dim` dims of `x [T, H, D]`."""
    d = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if d == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :d], x[..., d:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Convention (B), GLM in-place interleaved pairs (2j, 2j+1) over the first `rot_dim` dims; output stays
    interleaved."""
    d = cos.shape[-1]
    c = cos[:, None, : d // 2]
    s = sin[:, None, : d // 2]
    rot, rest = x[..., :d], x[..., d:]
    even, odd = rot[..., 0::2], rot[..., 1::2]
    out = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def apply_rope_deinterleave(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Convention (C), DeepSeek: interleaved pairs over all of `x [T, H, d]`, written out in half-split order."""
    d = cos.shape[-1]
    c = cos[:, None, : d // 2]
    s = sin[:, None, : d // 2]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * c - odd * s, odd * c + even * s), dim=-1)
