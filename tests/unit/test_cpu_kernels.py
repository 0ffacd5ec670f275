"""The C++ CPU kernels besides decode attention (`layers/csrc/int4_linear.cpp`, `fused_ops.cpp`):

* the int4 GEMM equals its definition (activations as two int8 digits per 32 inputs, exact integer dots, a float
  fold) and the dequantized float matmul to the output's rounding; every row is bit-identical alone and in any
  batch (that every code path, AVX-512 VNNI, AVX2 and plain C++, gives the same bits is
  tests/integration/test_cpu_kernel_builds.py);
* its packed layout round-trips and `Int4Linear` reads its weights back exactly; the same for the int8 GEMM;
* the fused RoPE and SiLU x up round as the eager ops do (bit for bit in bf16), and training keeps the eager ops.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlc.layers import quant_kernels as qk
from mlc.layers.activation import silu_and_mul
from mlc.layers.cpu_kernels import cpu_op
from mlc.layers.quant_linear import Int4Linear
from mlc.layers.rotary import apply_rope_neox, rope_neox_fused
from tests.support.kernel_inputs import int4_weights, int8_weights, rope_tables
from tests.support.kernel_marks import CPU_KERNELS

pytestmark = CPU_KERNELS


def two_digits(x):
    """The kernels' activations: per block of 32 inputs, the integer 256 a + a2 and d / 256 (float64), where
    a = round(x / d) with d = max|x| / 127 and a2 the rounded remainder in steps of d / 256."""
    m, k = x.shape
    xb = x.float().view(m, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax / 127
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    a = torch.round(xb * inv).clamp(-127, 127)
    a2 = torch.round((xb - a * d) * (256 * inv)).clamp(-127, 127)
    return (256 * a + a2).double(), (d / 256).squeeze(-1).double()


def int4_definition(x, q, scale_offsets, group):
    """What the int4 kernel computes, in float64 from the same integer codes: the two-digit activations dotted with
    the dequantized weights, block by block."""
    codes, d = two_digits(x)
    w = qk.dequantize_int4(qk.pack_int4(q), scale_offsets, group, torch.float64)
    return torch.einsum("mbi,nbi,mb->mn", codes, w.view(w.shape[0], -1, 32), d)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int4_gemm_equals_its_definition(group, dtype):
    n, k = 48, 256
    q, sz, packed = int4_weights(n, k, group)
    x = (torch.randn(70, k, generator=torch.Generator().manual_seed(1)) * 2).to(dtype)
    y = cpu_op("int4_linear")(x, packed, group)
    assert y.dtype == dtype and y.shape == (70, n)
    want = int4_definition(x, q, sz, group)
    tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]  # the output's rounding
    assert ((y.double() - want).abs().max() / want.abs().max()).item() < tol
    exact = x.double() @ qk.dequantize_int4(qk.pack_int4(q), sz, group, torch.float64).t()
    # about 16-bit activations: what is left is the output's rounding
    assert ((y.double() - exact).norm() / exact.norm()).item() < {torch.float32: 1e-4, torch.bfloat16: 5e-3,
                                                                  torch.float16: 1e-3}[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_gemm_rows_are_bit_identical_alone_and_in_any_batch(dtype):
    """70 rows cross the kernel's 4-row and 64-row blocks; each row must not notice."""
    _, _, packed = int4_weights(96, 576, 32)
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(2)).to(dtype)
    op = cpu_op("int4_linear")
    whole = op(x, packed, 32)
    assert all(torch.equal(op(x[i : i + 1], packed, 32)[0], whole[i]) for i in range(70))
    assert torch.equal(op(x[5:13], packed, 32), whole[5:13])
    assert torch.equal(op(x.flip(0), packed, 32).flip(0), whole)


def test_int4_gemm_zero_rows_and_bad_shapes():
    _, _, packed = int4_weights(32, 64, 32)
    op = cpu_op("int4_linear")
    assert torch.equal(op(torch.zeros(3, 64), packed, 32), torch.zeros(3, 32))
    assert op(torch.zeros(0, 64), packed, 32).shape == (0, 32)
    with pytest.raises(RuntimeError, match="inputs"):
        op(torch.zeros(2, 96), packed, 32)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(torch.zeros(2, 64), packed, 48)


@pytest.mark.parametrize("group", [32, 64, 128, 256])
def test_packed_layout_round_trips_and_the_layer_reads_its_weights_back(group):
    q, sz, packed = int4_weights(64, 512, group)
    assert packed.shape == (4, 512 // group, group * 8 + 64)
    back_q, back_sz = qk.unpack_int4_tiles(packed, group)
    assert torch.equal(back_q, q.to(torch.uint8)) and torch.equal(back_sz, sz)
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(4)) * 0.05
    layer = Int4Linear(w, group_size=group)
    assert layer.kernel == "mlc-int4" and layer.scale_offsets is None
    q, sz = qk.quantize_int4(w, group)
    assert torch.equal(layer.dequantized(), qk.dequantize_int4(qk.pack_int4(q), sz, group, torch.float32))
    assert layer.weight_bytes() == 64 * 512 // 2 + (512 // group) * 64 * 4  # codes, then an fp16 pair per group and row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_gemm_equals_its_definition_and_each_row_is_alone(dtype):
    q, scale, packed = int8_weights(64, 192)
    x = (torch.randn(70, 192, generator=torch.Generator().manual_seed(9)) * 2).to(dtype)
    op = cpu_op("int8_linear")
    y = op(x, packed)
    codes, d = two_digits(x)
    want = torch.einsum("mbi,nbi,mb->mn", codes, q.double().view(64, 6, 32), d) * scale.double()
    tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3}[dtype]
    assert ((y.double() - want).abs().max() / want.abs().max()).item() < tol
    assert all(torch.equal(op(x[i : i + 1], packed)[0], y[i]) for i in range(70))
    back_q, back_scale = qk.unpack_int8_tiles(packed)
    assert torch.equal(back_q, q) and torch.equal(back_scale, scale)


def test_int8_layer_picks_the_kernel_and_reads_its_weights_back():
    from mlc.layers.quant_linear import Int8Linear

    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(10)) * 0.05
    layer = Int8Linear(w, scheme="w8a8")
    assert layer.kernel == "mlc-int8" and layer.weight_bytes() == 96 * (128 + 4)
    q, scale = qk.quantize_int8(w)
    assert torch.equal(layer.dequantized(), qk.dequantize_int8(q, scale, torch.float32))
    assert Int8Linear(torch.randn(24, 128) * 0.05, scheme="w8a8").kernel != "mlc-int8"  # 24 rows: not 16-aligned


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_fused_rope_is_the_eager_rope_bit_for_bit(dtype, tokens):
    heads, kv, d = 9, 3, 64
    qkv = (torch.randn(tokens, (heads + 2 * kv) * d, generator=torch.Generator().manual_seed(6)) * 3).to(dtype)
    cos, sin = rope_tables(tokens, d, dtype)
    eager = apply_rope_neox(qkv[:, : (heads + kv) * d].view(tokens, heads + kv, d), cos, sin)
    with torch.inference_mode():
        assert torch.equal(rope_neox_fused(qkv, heads + kv, d, cos, sin), eager)


def test_partial_rotary_and_training_keep_the_eager_rope():
    qkv = torch.randn(3, 4 * 64, requires_grad=True)
    cos, sin = rope_tables(3, 64, torch.float32)
    out = rope_neox_fused(qkv, 2, 64, cos, sin)
    assert out.grad_fn is not None  # autograd sees the eager ops
    half_cos, half_sin = cos[:, :32], sin[:, :32]  # partial rotary: eager only
    with torch.no_grad():
        assert torch.equal(rope_neox_fused(qkv, 2, 64, half_cos, half_sin),
                           apply_rope_neox(qkv[:, :128].view(3, 2, 64), half_cos, half_sin))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_silu_mul_rounds_as_the_eager_ops(dtype):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(33, 2 * 1536, generator=g) * 4).to(dtype)
    x[0, :8] = torch.tensor([0.0, -0.0, 80.0, -80.0, 1e-3, -1e-3, 20.0, -20.0]).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    eager = F.silu(gate) * up
    with torch.inference_mode():
        fused = silu_and_mul(x)
    if dtype == torch.bfloat16:
        assert torch.equal(fused, eager)
    else:  # the exp may differ from torch's in a float's last bit, which a half's two roundings can carry
        bound = 2 * torch.finfo(dtype).eps * eager.float().abs() + torch.finfo(dtype).smallest_normal
        assert ((fused.float() - eager.float()).abs() <= bound).all()
        assert (fused != eager).float().mean() < 1e-3
    assert torch.equal(silu_and_mul(x[3:4]), fused[3:4])  # each row alone


def test_fp32_and_training_keep_the_eager_silu():
    x = torch.randn(4, 64)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(silu_and_mul(x), F.silu(gate) * up)
    y = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    assert silu_and_mul(y).grad_fn is not None



def _mapping_of(address: int, field: str = "AnonHugePages") -> tuple[str, int]:
    """The name (path, [heap], or '' for an anonymous mapping) and `field` kB (AnonHugePages, Rss) of the mapping
    holding address."""
    import re
    from pathlib import Path

    current: list = []
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$", line)
        if head:
            current = [int(head.group(1), 16) <= address < int(head.group(2), 16), head.group(3), 0]
        elif line.startswith(f"{field}:") and current and current[0]:
            return current[1], int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_packed_weights_get_fresh_huge_pages_after_the_heap_has_grown():
    """Packed weights live in a mapping of their own, advised for 2 MiB pages before the first write. glibc serves a
    large aligned allocation from its heap once a freed mapping has raised its mmap threshold, and heap pages touched
    before stay small whatever madvise says: a 1B model's loader left a third of its weights on 4 KiB pages, which
    streamed at two thirds of the rate."""
    import ctypes
    from pathlib import Path

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free(libc.malloc(24 << 20))  # a freed 24 MiB mapping raises glibc's threshold above the next request
    packed = cpu_op("on_huge_pages")(torch.ones(6 << 20, dtype=torch.uint8))
    assert torch.equal(packed, torch.ones(6 << 20, dtype=torch.uint8))
    name, huge_kb = _mapping_of(packed.data_ptr())
    assert name != "[heap]" and packed.data_ptr() % 4096 == 0
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        assert huge_kb >= 4096, f"only {huge_kb} kB of the 6 MiB are on 2 MiB pages"


def test_packed_weights_lie_end_to_end_and_give_their_pages_back():
    """Packed tensors share one mapping end to end (on whole 4 KiB pages each), so a 1 MiB one (a MoE's expert) is
    on 2 MiB pages too and none is rounded up to whole 2 MiB pages; a freed tensor's pages go back at once."""
    place = cpu_op("on_huge_pages")
    for _ in range(2):  # the first pair may straddle the end of a mapping
        a = place(torch.ones(1 << 20, dtype=torch.uint8))
        b = place(torch.full(((1 << 20) + 5,), 2, dtype=torch.uint8))
        if b.data_ptr() == a.data_ptr() + (1 << 20):
            break
    assert b.data_ptr() == a.data_ptr() + (1 << 20) and _mapping_of(a.data_ptr())[0] == ""
    assert torch.equal(a, torch.ones(1 << 20, dtype=torch.uint8)) and int(b.sum()) == 2 * ((1 << 20) + 5)
    big = place(torch.ones(16 << 20, dtype=torch.uint8))
    where = big.data_ptr()
    _, before = _mapping_of(where, "Rss")
    del big
    _, after = _mapping_of(where, "Rss")  # the mapping stays: it is the one new tensors are placed in
    assert before - after >= 15 << 10, f"freeing 16 MiB left the mapping at {after} of {before} kB"
    alone = place(torch.ones((128 << 20) + 1, dtype=torch.uint8))  # over half an arena: a mapping of its own
    assert alone.data_ptr() % (2 << 20) == 0 and int(alone[-1]) == 1
