"""Quantized KV stores (int8, int4): integer codes plus fp16 scales, dequantized on gather into the compute dtype.

Groups: one scale per token, per head row, per `group` consecutive values of the last dim (32 for int8 and int4:
a head row of 64 has 2 groups). Why per token and not per page: the engine writes one token at a time
(decode), so a token's scale is final when it is written (a page scale would have to re-quantize earlier entries
whenever a larger value arrives); copy-on-write and sparse compaction move single entries between pages, and an
entry moves with its own scale bit for bit; and one outlier token (attention sinks have large K/V) costs
resolution only for itself. The price: per 32 values, 2 bytes next to int8's 32 code bytes, 4 bytes (scale and
minimum) next to int4's 16.

Symmetric: code = round(x / s), s = absmax / (2^(bits-1) - 1), stored as int8 (int4: offset by 8 into a nibble).
Asymmetric: code = round((x - m) / s) unsigned, m = min, s = (max - min) / (2^bits - 1), m a second fp16.
int4 packs two codes a byte (even index in the low nibble). Scales are rounded up to fp16 so no code clips;
they are floored at fp16's smallest normal (2^-14), so a group whose values are all below ~1e-4 is exact only
to that absolute step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mlc.layers.kv_store import PagedTensor

_SCALE_MIN = 2.0**-14
_SCALE_MAX = 65504.0


@dataclass(frozen=True)
class QuantFormat:
    bits: int  # 8 or 4
    group: int  # target values per scale along the last dim
    symmetric: bool

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def layout(self, last: int) -> tuple[int, int]:
        """(groups, values per group) for a row of `last` values: balanced groups, even for int4; a row that does
        not divide is padded with zeros that are dropped on gather."""
        groups = max(1, math.ceil(last / self.group))
        size = math.ceil(last / groups)
        if self.bits == 4 and size % 2:
            size += 1
        return groups, size

    def code_bytes(self, last: int) -> int:
        groups, size = self.layout(last)
        return groups * size * self.bits // 8

    def param_count(self) -> int:
        """fp16 numbers stored per group: the scale, plus the minimum when asymmetric."""
        return 1 if self.symmetric else 2


# Measured on SmolLM2-135M. Relative RMS round-trip error of its cached K / V (400 tokens of Genesis, 30 layers):
#   int8 sym g64 1.07% / 0.64%, asym g64 0.76% / 0.56%;
#   int4 sym g32 15.0% / 10.3%, asym g32 9.9% / 8.1%, sym g16 11.2% / 8.9% (as many bytes as asym g32).
# Mean |logprob change| per token over 384 tokens of Genesis through the engine (fp16 0.0008, bf16 0.0051):
#   int8 sym g64 0.026, asym g64 0.021, sym g32 0.018, sym g16 0.014; int4 asym g32 0.209, asym g16 0.185.
# Keys have outlier channels, so smaller groups pay: int8 takes 32-value groups (like llama.cpp's q8_0). Key rows
# are not centred on zero, so int4 stores the minimum too (like q4_1), which beats symmetric at equal size.
FORMATS: dict[str, QuantFormat] = {
    "int8": QuantFormat(bits=8, group=32, symmetric=True),
    "int4": QuantFormat(bits=4, group=32, symmetric=False),
}


def code_dtype(fmt: QuantFormat) -> torch.dtype:
    """Symmetric int8 codes are stored signed, so dequantizing is one multiply; the rest are unsigned bytes."""
    return torch.int8 if fmt.bits == 8 and fmt.symmetric else torch.uint8


def quantize(x: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[..., last]` -> (codes `[..., code_bytes]`, params fp16 `[..., groups, param_count]`)."""
    last = x.shape[-1]
    groups, size = fmt.layout(last)
    x = x.float()
    if groups * size != last:
        x = torch.nn.functional.pad(x, (0, groups * size - last))
    x = x.reshape(*x.shape[:-1], groups, size)
    if fmt.symmetric:
        half = (1 << (fmt.bits - 1)) - 1
        scale = _to_fp16_up(x.abs().amax(-1, keepdim=True) / half)
        codes = torch.round(x / scale.float()).clamp_(-half, half)
        if fmt.bits == 4:
            codes += half + 1
        params = scale
    else:
        low = x.amin(-1, keepdim=True).clamp(-_SCALE_MAX, _SCALE_MAX).half()
        scale = _to_fp16_up((x.amax(-1, keepdim=True) - low.float()) / fmt.levels)
        codes = torch.round((x - low.float()) / scale.float()).clamp_(0, fmt.levels)
        params = torch.cat((scale, low), dim=-1)
    codes = codes.to(code_dtype(fmt)).flatten(-2)
    if fmt.bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return codes, params


def dequantize(codes: torch.Tensor, params: torch.Tensor, fmt: QuantFormat, last: int, dtype: torch.dtype):
    """Inverse of `quantize`: `[..., last]` in `dtype`."""
    groups, size = fmt.layout(last)
    if fmt.bits == 4:
        codes = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)
    q = codes.unflatten(-1, (groups, size))
    scale = params[..., :1].to(torch.float32)
    x = q * scale  # bytes times fp32 scales: one pass, no float copy of the codes first
    if fmt.bits == 4 and fmt.symmetric:
        x.sub_(scale * (1 << (fmt.bits - 1)))
    elif not fmt.symmetric:
        x.add_(params[..., 1:2].to(torch.float32))
    x = x.flatten(-2)
    return (x[..., :last] if groups * size != last else x).to(dtype)


def _to_fp16_up(scale: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 at or above `scale` (within the clamp), so no value's code overflows the range."""
    scale = scale.clamp(_SCALE_MIN, _SCALE_MAX)
    half = scale.half()
    up = torch.nextafter(half, torch.full_like(half, float("inf"))).clamp_(max=_SCALE_MAX)
    return torch.where(half.float() < scale, up, half)


class QuantizedPagedTensor(PagedTensor):
    """A PagedTensor whose slots hold integer codes (`data`) and fp16 group parameters (`params`)."""

    def __init__(self, num_slots: int, shape: tuple[int, ...], fmt: QuantFormat, device: torch.device | str):
        self.shape, self.fmt = tuple(shape), fmt
        rows, last = self.shape[:-1], self.shape[-1]
        groups, _ = fmt.layout(last)
        self.data = torch.empty((num_slots, *rows, fmt.code_bytes(last)), dtype=code_dtype(fmt), device=device)
        self.params = torch.empty((num_slots, *rows, groups, fmt.param_count()), dtype=torch.float16, device=device)

    def bytes_per_token(self) -> int:
        return self.data[0].numel() * self.data.element_size() + self.params[0].numel() * self.params.element_size()

    def write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        codes, params = quantize(values, self.fmt)
        self.data.index_copy_(0, slots, codes)
        self.params.index_copy_(0, slots, params)

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        flat = slots.reshape(-1)  # index_select: several times faster than advanced indexing on bytes
        codes = self.data.index_select(0, flat).view(*slots.shape, *self.data.shape[1:])
        params = self.params.index_select(0, flat).view(*slots.shape, *self.params.shape[1:])
        return dequantize(codes, params, self.fmt, self.shape[-1], dtype)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.data[dst] = self.data[src]
        self.params[dst] = self.params[src]

    def clear(self, slots: slice) -> None:
        """Zero codes and parameters: a cleared slot dequantizes to exact zeros in both formats."""
        self.data[slots] = 0
        self.params[slots] = 0


def new_paged_tensor(
    num_slots: int, shape: tuple[int, ...], dtype: torch.dtype | str, device: torch.device | str
) -> PagedTensor:
    """A store for one cache tensor: a float dtype is stored as is, "int8"/"int4" quantized."""
    if isinstance(dtype, str):
        if dtype not in FORMATS:
            raise ValueError(f"KV store dtype {dtype!r} is unknown; use a torch float dtype, 'int8' or 'int4'")
        return QuantizedPagedTensor(num_slots, shape, FORMATS[dtype], device)
    return PagedTensor(num_slots, shape, dtype, device)
