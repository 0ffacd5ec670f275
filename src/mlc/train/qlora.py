"""QLoRA: the frozen base's linear layers stored 4-bit while the LoRA adapter trains in full precision
(`finetuning_type: qlora`, LLaMA-Factory's `quantization_bit: 4`).

Each weight row is cut into groups of `GROUP` values stored as 4-bit codes with a bf16 scale and minimum per group
(w = code x scale + min, codes 0..15 over the group's range): 0.5625 bytes a weight against bf16's 2, 0.28x. The
forward dequantizes one layer's weight at a time in the compute dtype; the backward dequantizes it again for the
input's gradient and keeps no weight between the two (the base is frozen, so there is no weight gradient). Every
`nn.Linear` of the decoder layers is quantized, the LoRA-wrapped ones under their adapter included; the embeddings
and the output head stay as they are (they are read, not multiplied, or feed the loss directly). The base is loaded
in full precision first and quantized on its device, so the load's peak is the full model's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlc.errors import ConfigError

GROUP = 64


def quantize_4bit(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes packed two a byte [out, in / 2], scales [out, in / group], minimums [out, in / group]), bf16 stats."""
    out_f, in_f = weight.shape
    w = weight.detach().float().reshape(out_f, in_f // group, group)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-8).to(torch.bfloat16)
    lo = lo.to(torch.bfloat16)
    codes = ((w - lo.float()) / scale.float()).round().clamp(0, 15).to(torch.uint8).reshape(out_f, in_f)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, scale.squeeze(-1), lo.squeeze(-1)


def dequantize_4bit(packed: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out_f, groups = scale.shape
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(out_f, groups, -1)
    w = codes.to(dtype) * scale.to(dtype).unsqueeze(-1) + lo.to(dtype).unsqueeze(-1)
    return w.reshape(out_f, -1)


class _FrozenLinear4(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: Linear4bit, dtype: torch.dtype) -> torch.Tensor:
        ctx.layer, ctx.in_dtype = layer, x.dtype
        return F.linear(x.to(dtype), layer.weight_dequantized(dtype), layer.bias_in(dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_x = grad @ ctx.layer.weight_dequantized(grad.dtype)
        return grad_x.to(ctx.in_dtype), None, None


class Linear4bit(nn.Module):
    """A frozen `nn.Linear` stored 4-bit (see the module's docstring); `in_features` / `out_features` as nn.Linear's."""

    def __init__(self, linear: nn.Linear, group: int = GROUP) -> None:
        super().__init__()
        if linear.in_features % group:
            raise ConfigError(f"finetuning_type: qlora needs every linear layer's input width to be a multiple of "
                              f"{group}; one layer has {linear.in_features}: use finetuning_type: lora")
        self.in_features, self.out_features, self.group = linear.in_features, linear.out_features, group
        self.stored_dtype = linear.weight.dtype
        packed, scale, lo = quantize_4bit(linear.weight, group)
        self.register_buffer("packed", packed)
        self.register_buffer("scale", scale)
        self.register_buffer("lo", lo)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        kind = x.device.type
        if torch.is_autocast_enabled(kind):
            return torch.get_autocast_dtype(kind)
        return x.dtype if x.dtype.is_floating_point else self.stored_dtype

    def weight_dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_4bit(self.packed, self.scale, self.lo, dtype)  # type: ignore[arg-type]

    def bias_in(self, dtype: torch.dtype) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.to(dtype)  # type: ignore[return-value]

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (in the dtype it was loaded in), for code that reads a layer's weight: a copy, so
        merging an adapter into it in memory (PEFT's merge) would be lost; `mlc-cli export --merge` merges onto the
        base as loaded instead."""
        return self.weight_dequantized(self.stored_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.compute_dtype(x)  # autocast's dtype, read before it is switched off for the function
        with torch.autocast(x.device.type, enabled=False):
            return _FrozenLinear4.apply(x, self, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, 4-bit groups of {self.group}"


def quantize_base(peft_model) -> dict[str, int]:
    """Replace every frozen `nn.Linear` of the decoder layers (a LoRA layer's base layer included) with a
    `Linear4bit`. Returns the base's linear bytes before and after and how many layers were quantized."""
    decoder = peft_model.get_base_model().get_decoder()
    before = after = count = 0
    for module in list(decoder.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not nn.Linear or child.weight.requires_grad:
                continue  # LoRA's own A and B (and anything trained) stay as they are
            q = Linear4bit(child)
            before += child.weight.numel() * child.weight.element_size()
            after += sum(int(b.numel()) * b.element_size() for b in (q.packed, q.scale, q.lo)
                         if isinstance(b, torch.Tensor))
            setattr(module, child_name, q)
            count += 1
    if not count:
        raise ConfigError("finetuning_type: qlora found no linear layer to store 4-bit in this model's decoder; "
                          "use finetuning_type: lora")
    return {"layers": count, "bytes_before": before, "bytes_after": after}
