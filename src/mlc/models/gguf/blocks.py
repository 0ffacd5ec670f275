"""A GGUF's 4-bit blocks read as they are: each tensor's codes and, per group of 32 weights, the scale and offset
that give `w = q * scale + offset` (mlc's int4 layout, `layers/quant_kernels.py`), without a float copy.

- Q4_0, blocks of 32 (fp16 d, 16 bytes of codes): scale d, offset -8 d, kept exactly (the pairs are fp16).
- Q4_1, blocks of 32 (fp16 d and m, 16 bytes of codes): scale d, offset m, kept exactly.
- Q4_K, blocks of 256 (fp16 d and dmin, eight six-bit (sc, m), 128 bytes of codes): per group of 32, scale d sc and
  offset -dmin m; the codes are kept exactly, the scale and offset rounded to fp16 (at most 2^-11 relative).

Codes are returned in the row order of the file (`[N, K]`, HF's `[out, in]`); the caller permutes rows as the
floats would be (llama's q/k rope layout).
"""

from __future__ import annotations

import numpy as np
import torch

from mlc.errors import ModelFormatError

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # the GGUF types served by the int4 kernel from their own codes
_BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}  # weights and bytes per block


def _blocks(raw: np.ndarray, kind: str, rows: int, cols: int, name: str) -> np.ndarray:
    """The tensor's bytes as `[rows, blocks per row, block bytes]`; a size that does not match is a damaged file."""
    per, size = _BLOCK[kind]
    if cols % per:
        raise ModelFormatError(f"tensor {name!r} ({kind}) has rows of {cols} values, not a whole number of "
                               f"{per}-value blocks; the file is damaged or not a GGUF this mlc reads")
    data = np.asarray(raw, dtype=np.uint8).reshape(-1)
    want = rows * (cols // per) * size
    if data.size != want:
        raise ModelFormatError(f"tensor {name!r} ({kind}, {rows} x {cols}) holds {data.size} bytes where its blocks "
                               f"need {want}; the file is truncated or damaged: download it again")
    return data.reshape(rows, cols // per, size)


def _half(b: np.ndarray) -> np.ndarray:
    """Two little-endian bytes (last axis) as float32 values of the fp16 they hold."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes per group -> 32 codes: the low nibbles are values 0..15, the high ones 16..31 (Q4_0/Q4_1)."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes -> 8 six-bit scales and 8 six-bit minimums (llama.cpp's get_scale_min_k4)."""
    s = packed.astype(np.uint8)
    sc = np.empty(packed.shape[:-1] + (8,), dtype=np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def int4_codes(raw: np.ndarray, kind: str, rows: int, cols: int, name: str = "?") -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 `[rows, cols]` in 0..15, scale_offsets fp16 `[cols / 32, rows, 2]`) of a Q4_0, Q4_1 or Q4_K
    tensor, from its raw bytes."""
    b = _blocks(raw, kind, rows, cols, name)
    if kind in ("Q4_0", "Q4_1"):
        d = _half(b[..., 0:2])
        offset = _half(b[..., 2:4]) if kind == "Q4_1" else -8 * d
        q = _nibbles(b[..., 4 if kind == "Q4_1" else 2:])
        scale = d
    elif kind == "Q4_K":
        d, dmin = _half(b[..., 0:2])[..., None], _half(b[..., 2:4])[..., None]
        sc, mn = _k_scales(b[..., 4:16])
        scale, offset = (d * sc).reshape(rows, -1), (-(dmin * mn)).reshape(rows, -1)  # 8 groups per block
        qs = b[..., 16:].reshape(rows, -1, 4, 32)  # 4 pairs of groups per block, 32 bytes each
        q = np.concatenate((qs & 0x0F, qs >> 4), axis=-1).reshape(rows, -1, 32)  # pair j: low nibbles, then high
    else:
        raise ValueError(f"{kind} is not one of {INT4_TYPES}")
    codes = torch.from_numpy(np.ascontiguousarray(q.reshape(rows, cols), dtype=np.uint8))
    pairs = np.stack((scale.reshape(rows, -1), offset.reshape(rows, -1)), axis=-1).astype(np.float16)
    return codes, torch.from_numpy(np.ascontiguousarray(pairs.transpose(1, 0, 2)))
