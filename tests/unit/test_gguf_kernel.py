"""The gguf kernel (`csrc/gguf_linear.cpp`, `layers/gguf_linear.py`) reads every GGUF type it serves at the file's own
bits: its rows dequantize to exactly what the `gguf` package gives, its products match the float product of those
weights within the two-digit activations' rounding, a row's result does not depend on its batch, and damaged input
is a clear error. (The AVX2 and plain C++ builds are checked against this one in
tests/integration/test_cpu_kernel_builds.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from mlc.errors import ModelFormatError
from mlc.layers.cpu_kernels import cpu_op
from mlc.layers.gguf_linear import GGUF_KINDS, GGUFLinear, GGUFPart, gguf_kernel_fits
from tests.support.kernel_inputs import random_gguf_blocks
from tests.support.kernel_marks import CPU_KERNELS

pytestmark = CPU_KERNELS
ROWS, COLS = 48, 512
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # the types the gguf package can quantize real values to
BITS = {"Q4_0": 4.5, "Q4_1": 5.0, "Q5_0": 5.5, "Q5_1": 6.0, "Q8_0": 8.5, "Q4_K": 4.625, "Q5_K": 5.625,
        "Q6_K": 6.5625, "IQ4_NL": 4.5, "IQ4_XS": 4.3125}  # packed bits a weight: the file's, K-quants + 1/8


def reference(raw: np.ndarray, kind: str) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(ROWS, COLS))


def blocks(kind: str, seed: int = 0) -> np.ndarray:
    if kind in QUANTIZABLE:
        w = np.random.default_rng(seed).standard_normal((ROWS, COLS)).astype(np.float32) * 0.05
        return quants.quantize(w, GGMLQuantizationType[kind])
    return random_gguf_blocks(kind, ROWS, COLS, seed)


@pytest.mark.parametrize("kind", GGUF_KINDS)
def test_rows_are_the_gguf_packages_values_exactly(kind):
    raw = blocks(kind)
    ids = torch.tensor([5, 0, 47, 5])
    got = cpu_op("gguf_rows")(torch.from_numpy(raw), ids, GGUF_KINDS.index(kind), COLS)
    assert torch.equal(got, reference(raw, kind)[ids])


@pytest.mark.parametrize("kind", GGUF_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [11, 37])
def test_product_matches_the_dequantized_weights(kind, dtype, rows):
    """Within 1e-4 of the float64 product (the activations' two int8 digits carry about 16 bits), alone or in any
    batch bit for bit (37 rows: 4 at a time, then 1), at the file's bit width in memory."""
    raw = blocks(kind, seed=1)
    layer = GGUFLinear([GGUFPart(torch.from_numpy(raw), kind)], COLS)
    x = torch.randn(rows, COLS, generator=torch.Generator().manual_seed(2)).to(dtype)
    y = layer(x)
    want = x.double() @ reference(raw, kind).double().t()
    assert y.dtype == dtype
    assert ((y.double() - want).norm() / want.norm()).item() < (1e-4 if dtype == torch.float32 else 5e-3)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(alone, y)
    assert layer.weight_bytes() * 8 == BITS[kind] * ROWS * COLS
    assert torch.equal(layer.dequantized(), reference(raw, kind))


def test_a_merged_layer_keeps_each_parts_type():
    """A Q4_K_M file's q and k in Q4_K beside v in Q6_K: one GGUFLinear, each part at its own type, in order."""
    kinds = ("Q4_K", "Q4_K", "Q6_K")
    raws = [random_gguf_blocks(k, 16 * (i + 1), COLS, seed=i) for i, k in enumerate(kinds)]
    layer = GGUFLinear([GGUFPart(torch.from_numpy(r), k) for r, k in zip(raws, kinds)], COLS,
                       shard_sizes=[r.shape[0] for r in raws])
    assert layer.kernel == "gguf-Q4_K+Q6_K" and len(layer.runs) == 2
    x = torch.randn(3, COLS)
    w = torch.cat([torch.from_numpy(quants.dequantize(r, GGMLQuantizationType[k]).reshape(-1, COLS))
                   for r, k in zip(raws, kinds)])
    want = x.double() @ w.double().t()
    assert ((layer(x).double() - want).norm() / want.norm()).item() < 1e-4
    assert [t.shape[-1] for t in layer.split(layer(x))] == [16, 32, 48]


def test_rows_served_in_another_order():
    """llama's q and k rows, stored in llama.cpp's rope order, are served in HF's (the `rows` order)."""
    raw = blocks("Q4_0")
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(0))
    layer = GGUFLinear([GGUFPart(torch.from_numpy(raw), "Q4_0", order)], COLS)
    assert torch.equal(layer.dequantized(), reference(raw, "Q4_0")[order])


def test_a_block_with_an_inf_scale_is_a_clear_error_naming_the_tensor():
    raw = blocks("Q8_0").copy()
    raw[17, 34 * 3 : 34 * 3 + 2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    with pytest.raises(ModelFormatError, match=r"blk\.3\.ffn_down\.weight \(Q8_0\): damaged block: row 17.*download"):
        GGUFLinear([GGUFPart(torch.from_numpy(raw), "Q8_0", name="blk.3.ffn_down.weight")], COLS)


def test_shapes_the_kernel_cannot_take_are_refused_before_packing():
    assert gguf_kernel_fits("Q4_K", 32, 512) and gguf_kernel_fits("Q4_0", 32, 96)
    assert not gguf_kernel_fits("Q4_K", 32, 96)  # not whole 256-value super-blocks
    assert not gguf_kernel_fits("Q4_0", 24, 64)  # rows not in tiles of 16
    assert not gguf_kernel_fits("Q2_K", 32, 512)  # no kernel for this type: dequantized instead
    with pytest.raises(RuntimeError, match="tiles of 16"):
        cpu_op("gguf_pack")(torch.zeros(24, 36, dtype=torch.uint8), GGUF_KINDS.index("Q4_0"), 64)
    with pytest.raises(RuntimeError, match="takes 36 bytes"):
        cpu_op("gguf_pack")(torch.zeros(32, 40, dtype=torch.uint8), GGUF_KINDS.index("Q4_0"), 64)
