"""Quantized weight formats, their pure-torch dequantization, and probes for the CPU kernels that use them.

int8: symmetric per output channel, `w ~= q * scale[n]`, q in [-127, 127].
int4: per group of `g` input columns, `w = q * scale + offset`, q in [0, 15], `scale_offsets [K/g, N, 2]` in fp16.
Stored two values a byte. This holds a GGUF's Q4_0 (`scale = d, offset = -8 d`) and Q4_1 (`scale = d, offset = m`)
blocks exactly, since their d and m are fp16 too. torch's tinygemm kernel (the fallback without the C++ kernels)
takes `w = (q - 8) * scale + zero` in bf16 instead (`to_tinygemm`).
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what `_weight_int4pack_mm_for_cpu` accepts
INT4_SCALE_DTYPE = torch.float16  # GGUF's Q4_0 / Q4_1 block scales and minimums are fp16: kept exactly


def quantize_int8(w: torch.Tensor, reduce_amax=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`[N, K]` float -> (int8 `[N, K]`, fp32 scale `[N]`). `reduce_amax` turns this slice's per-row absolute
    maximum into the whole row's (a row-parallel layer's ranks each hold some of the K columns)."""
    w = w.float()
    lo, hi = torch.aminmax(w, dim=1)
    amax = torch.maximum(-lo, hi)
    scale = ((amax if reduce_amax is None else reduce_amax(amax)) / 127).clamp(min=1e-12)
    q = (w / scale[:, None]).round_().clamp_(-127, 127)  # in place: loading a model quantizes every weight once
    return q.to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(torch.float32) * scale[:, None]).to(dtype)


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[N, K]` float -> (int32 values 0..15 `[N, K]`, scale_offsets `[K/g, N, 2]` in INT4_SCALE_DTYPE).

    Scales and offsets are rounded to fp16 before the weights are rounded against them, so that rounding is not
    added to the quantization error."""
    n, k = w.shape
    grouped = w.float().reshape(n, k // group, group)
    lo, hi = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-6).to(INT4_SCALE_DTYPE).float()
    offset = lo.to(INT4_SCALE_DTYPE).float()
    q = ((grouped - offset[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.int32)
    scale_offsets = torch.stack((scale, offset), dim=-1).transpose(0, 1).contiguous().to(INT4_SCALE_DTYPE)
    return q.reshape(n, k), scale_offsets


def to_tinygemm(scale_offsets: torch.Tensor) -> torch.Tensor:
    """`scale_offsets` as torch's int4 kernel takes them: `[K/g, N, 2]` bf16 (scale, zero), `w = (q - 8) s + zero`."""
    scale, offset = scale_offsets.float().unbind(-1)
    return torch.stack((scale, offset + 8 * scale), dim=-1).to(torch.bfloat16)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int values 0..15 `[N, K]` -> uint8 `[N, K/2]`, even columns in the low nibble."""
    q = q.to(torch.uint8)
    return (q[:, 1::2] << 4) | q[:, 0::2]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 `[N, K/2]` -> uint8 values `[N, K]`."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def pack_int4_tiles(q: torch.Tensor, scale_offsets: torch.Tensor, group: int) -> torch.Tensor:
    """int values 0..15 `[N, K]` and their scale_offsets `[K/g, N, 2]` -> the C++ int4 kernel's layout, uint8
    `[N/16, K/g, 8 g + 64]`: one stream per 16 output columns, group after group, each group its codes then its 16
    (scale, offset) fp16 pairs. In a chunk of 8 inputs, byte `4 j + i` holds column j's input i (low nibble) and
    input 4 + i (high nibble)."""
    n, k = q.shape
    q5 = q.to(torch.uint8).view(n // 16, 16, k // 8, 2, 4)  # [tile, column, chunk, half, input]
    codes = (q5[:, :, :, 0] | (q5[:, :, :, 1] << 4)).permute(0, 2, 1, 3).reshape(n // 16, k // group, group * 8)
    pairs = scale_offsets.to(INT4_SCALE_DTYPE).view(k // group, n // 16, 16 * 2).transpose(0, 1).contiguous()
    return torch.cat((codes, pairs.view(torch.uint8)), dim=2).contiguous()


def unpack_int4_tiles(tiles: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack_int4_tiles`: (uint8 values `[N, K]`, scale_offsets `[K/g, N, 2]`)."""
    t, groups, _ = tiles.shape
    b = tiles[:, :, : group * 8].reshape(t, groups * group // 8, 16, 4)
    q = torch.stack((b & 0xF, b >> 4), dim=3).permute(0, 2, 1, 3, 4).reshape(t * 16, groups * group)
    pairs = tiles[:, :, group * 8:].contiguous().view(INT4_SCALE_DTYPE).view(t, groups, 16, 2)
    return q, pairs.transpose(0, 1).reshape(groups, t * 16, 2).contiguous()


def pack_int8_tiles(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 `[N, K]` and fp32 per-row scales `[N]` -> the C++ int8 kernel's layout, uint8 `[N/16, 16 K + 64]`: one
    stream per 16 output rows, K/4 chunks of 64 bytes (byte `4 j + i` is row j's input i, stored as q + 128), then
    the 16 rows' float scales."""
    n, k = q.shape
    codes = (q.to(torch.int16) + 128).to(torch.uint8).view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3)
    scales = scale.float().contiguous().view(n // 16, 16).view(torch.uint8)
    return torch.cat((codes.reshape(n // 16, k * 16), scales), dim=1).contiguous()


def int8_tiles_fit(out_features: int, in_features: int) -> bool:
    """The C++ int8 kernel's shapes: tiles of 16 output rows, activation blocks of 32 inputs."""
    return out_features % 16 == 0 and in_features % 32 == 0


def unpack_int8_tiles(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack_int8_tiles`: (int8 `[N, K]`, fp32 scales `[N]`)."""
    t, width = tiles.shape
    k = (width - 64) // 16
    codes = tiles[:, : k * 16].reshape(t, k // 4, 16, 4).permute(0, 2, 1, 3).reshape(t * 16, k)
    return (codes.to(torch.int16) - 128).to(torch.int8), tiles[:, k * 16:].contiguous().view(torch.float32).reshape(-1)


def dequantize_int4(packed: torch.Tensor, scale_offsets: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    q = unpack_int4(packed).float()
    n, k = q.shape
    scale = scale_offsets[..., 0].t().float()[:, :, None]  # [N, K/g, 1]
    offset = scale_offsets[..., 1].t().float()[:, :, None]
    return (q.reshape(n, k // group, group) * scale + offset).reshape(n, k).to(dtype)


# CPU kernels: each probe runs the op once on a tiny input, so a build without it (or a torch that dropped it)
# falls back to the reference path instead of failing mid-request.
def _works(fn) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn()
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


@functools.cache
def has_fbgemm_int8() -> bool:
    """quantized::linear_dynamic: int8 weights, activations quantized per call (per tensor, uint8), fp32 out."""
    return _works(lambda: torch.ops.quantized.linear_dynamic(torch.ones(1, 16), prepack_int8(*quantize_int8(
        torch.ones(16, 16))), False))


@functools.cache
def has_int8pack() -> bool:
    """aten._weight_int8pack_mm: int8 weights, bf16 activations (W8A16)."""
    return _works(lambda: torch.ops.aten._weight_int8pack_mm(
        torch.ones(1, 16, dtype=torch.bfloat16), torch.ones(16, 16, dtype=torch.int8),
        torch.ones(16, dtype=torch.bfloat16)))


@functools.cache
def has_int_mm() -> bool:
    """aten._int_mm: int8 x int8 -> int32 GEMM (W8A8 with exact integer accumulation)."""
    return _works(lambda: torch._int_mm(torch.ones(1, 16, dtype=torch.int8), torch.ones(16, 16, dtype=torch.int8)))


def int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `x` as int8 codes with one fp32 scale each (`[M, 1]`): symmetric, round to nearest."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    return (xf / scale).round_().clamp_(-127, 127).to(torch.int8), scale


@functools.cache
def has_int4pack() -> bool:
    """aten._weight_int4pack_mm_for_cpu: group-wise int4 weights, bf16 activations (W4A16)."""
    return _works(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
        torch.ones(1, 32, dtype=torch.bfloat16), prepack_int4(torch.zeros(16, 32, dtype=torch.int32)), 32,
        torch.ones(1, 16, 2, dtype=torch.bfloat16)))  # bf16 (scale, zero): see to_tinygemm


@functools.cache
def has_fbgemm_fp16() -> bool:
    """quantized::linear_dynamic_fp16: fp16 weights, fp32 activations and accumulation."""
    return _works(lambda: torch.ops.quantized.linear_dynamic_fp16(
        torch.ones(1, 16), torch.ops.quantized.linear_prepack_fp16(torch.ones(16, 16), None)))


@functools.cache
def cpu_has_vnni() -> bool:
    """Without VNNI, fbgemm's u8*s8 pairs can saturate int16, so activations must use 7 bits (reduce_range)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags or "amx_int8" in flags


def prepack_int8(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
    """fbgemm's packed weight (an opaque object) from int8 `[N, K]` and per-channel scales."""
    zeros = torch.zeros(q.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that quantized tensors are deprecated; this is their last use
        qt = torch._make_per_channel_quantized_tensor(q.cpu(), scale.double().cpu(), zeros, 0)
        return torch.ops.quantized.linear_prepack(qt, None if bias is None else bias.float().cpu())


def prepack_int4(q: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).cpu(), 2)


def int4pack_fits(out_features: int, in_features: int, group: int) -> bool:
    return out_features % 16 == 0 and in_features % group == 0 and group in INT4_GROUP_SIZES
