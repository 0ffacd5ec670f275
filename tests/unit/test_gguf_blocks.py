"""A GGUF's 4-bit blocks read as codes and (scale, offset) pairs (`models/gguf/blocks.py`) give the weights the `gguf`
package's own dequantization gives: Q4_0 and Q4_1 bit for bit, Q4_K to the fp16 rounding of its sub-block scale
and minimum; and a truncated tensor is a clear error naming it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from mlc.errors import ModelFormatError
from mlc.layers import quant_kernels as qk
from mlc.models.gguf.blocks import int4_codes

ROWS, COLS = 48, 512


def dequantized(codes: torch.Tensor, scale_offsets: torch.Tensor) -> np.ndarray:
    return qk.dequantize_int4(qk.pack_int4(codes), scale_offsets, 32, torch.float32).numpy()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_0_and_q4_1_blocks_are_kept_exactly(kind):
    w = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32) * 0.05
    raw = quants.quantize(w, GGMLQuantizationType[kind])
    codes, pairs = int4_codes(raw, kind, ROWS, COLS)
    assert codes.shape == (ROWS, COLS) and int(codes.max()) <= 15 and pairs.shape == (COLS // 32, ROWS, 2)
    assert pairs.dtype == torch.float16
    want = quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(ROWS, COLS)
    assert np.array_equal(dequantized(codes, pairs), want)


def random_q4_k(rows: int, cols: int, seed: int = 1) -> np.ndarray:
    """Q4_K blocks with random codes, six-bit scales and minimums, and fp16 d / dmin of a real model's size."""
    rng = np.random.default_rng(seed)
    blocks = rows * cols // 256
    d = (rng.uniform(1e-4, 3e-3, blocks)).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    dmin = (rng.uniform(1e-4, 3e-3, blocks)).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    scales = rng.integers(0, 256, (blocks, 12), dtype=np.uint8)
    qs = rng.integers(0, 256, (blocks, 128), dtype=np.uint8)
    return np.concatenate((d, dmin, scales, qs), axis=1).reshape(rows, cols // 256 * 144)


def test_q4_k_codes_are_kept_and_scales_rounded_to_fp16_only():
    raw = random_q4_k(ROWS, COLS)
    codes, pairs = int4_codes(raw, "Q4_K", ROWS, COLS)
    want = quants.dequantize(raw, GGMLQuantizationType.Q4_K).reshape(ROWS, COLS)
    got = dequantized(codes, pairs)
    # each weight is scale * q + offset with both rounded to fp16: at most 2^-11 of each term
    scale = np.repeat(pairs[..., 0].t().float().numpy(), 32, axis=1)
    offset = np.repeat(pairs[..., 1].t().float().numpy(), 32, axis=1)
    bound = 2.0**-11 * (np.abs(scale) * 15 + np.abs(offset)) + 1e-9
    assert (np.abs(got - want) <= bound).all()
    assert np.abs(got - want).max() > 0  # the test would pass trivially if the scales were not rounded at all


def test_a_truncated_tensor_is_a_clear_error_naming_it():
    raw = quants.quantize(np.ones((4, 64), dtype=np.float32), GGMLQuantizationType.Q4_0)
    with pytest.raises(ModelFormatError, match="blk.0.attn_q.weight.*truncated"):
        int4_codes(raw.reshape(-1)[:-5], "Q4_0", 4, 64, "blk.0.attn_q.weight")
    with pytest.raises(ModelFormatError, match="whole number"):
        int4_codes(raw, "Q4_0", 4, 60, "t")
