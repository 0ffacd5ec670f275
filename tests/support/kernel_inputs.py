"""Fixed inputs for the C++ CPU kernel tests, and the kernels' outputs on them that every build must agree on.

This file imports nothing from the tests: tests/integration/test_cpu_kernel_builds.py runs it in a fresh interpreter
(`runpy.run_path`) under another -march build."""

from __future__ import annotations

import numpy as np
import torch

from mlc.layers import quant_kernels as qk
from mlc.layers.cpu_kernels import cpu_op
from mlc.layers.gguf_linear import GGUF_KINDS

# where each GGUF block type keeps its fp16 scales (d; m or dmin), which random bytes must not make inf or nan
_HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
           "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,), "Q2_K": (80, 82), "Q3_K": (108,)}


def random_gguf_blocks(kind: str, rows: int, cols: int, seed: int = 0, lo: float = 1e-4,
                       hi: float = 3e-3) -> np.ndarray:
    """`[rows, bytes per row]` of random blocks of a GGUF type: every code, sub-block scale and minimum drawn at
    random (random bytes are valid blocks of these types), the fp16 scales uniform in [lo, hi]."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    rng = np.random.default_rng(seed)
    per, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    n = rows * cols // per
    b = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at in _HALVES[kind]:
        b[:, at : at + 2] = rng.uniform(lo, hi, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return b.reshape(rows, cols // per * size)


def int4_weights(n, k, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, scale_offsets = qk.quantize_int4(torch.randn(n, k, generator=g) * 0.05, group)
    return q, scale_offsets, qk.pack_int4_tiles(q, scale_offsets, group)


def int8_weights(n, k, seed=0):
    q, scale = qk.quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05)
    return q, scale, qk.pack_int8_tiles(q, scale)


def rope_tables(t, d, dtype, seed=5):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 8192, (t,), generator=g).float()
    freqs = pos[:, None] * (10000 ** (-torch.arange(0, d, 2).float() / d))[None]
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def cross_arch_outputs() -> dict[str, torch.Tensor]:
    """The int4, int8 and gguf GEMMs (every GGUF type) and the fused ops on fixed inputs (what every build must
    agree on)."""
    g = torch.Generator().manual_seed(8)
    out = {}
    for group in (32, 64):
        _, _, packed = int4_weights(48, 256, group)
        x = torch.randn(9, 256, generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            out[f"int4-g{group}-{dtype}"] = cpu_op("int4_linear")(x.to(dtype), packed, group)
    _, _, packed8 = int8_weights(32, 128)
    x = torch.randn(9, 128, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        out[f"int8-{dtype}"] = cpu_op("int8_linear")(x.to(dtype), packed8)
    for i, kind in enumerate(GGUF_KINDS):
        packed = cpu_op("gguf_pack")(torch.from_numpy(random_gguf_blocks(kind, 32, 512, seed=i)), i, 512)
        x = torch.randn(9, 512, generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            out[f"gguf-{kind}-{dtype}"] = cpu_op("gguf_linear")(x.to(dtype), packed, i)
    qkv = (torch.randn(5, 15 * 64, generator=g) * 3).to(torch.bfloat16)
    cos, sin = rope_tables(5, 64, torch.bfloat16)
    out["rope"] = cpu_op("rope_neox")(qkv, cos, sin, 12, 64)
    out["silu"] = cpu_op("silu_mul")((torch.randn(5, 512, generator=g) * 4).to(torch.bfloat16))
    return out
