"""The C++ decode-attention kernel (`layers/cpu_kernels.py`, `csrc/decode_attention.cpp`): the SDPA path's result
read in place through the page table (fp32 to 1e-6, bf16 to its rounding), each sequence bit-identical alone and in
any batch, and the SDPA path wherever it does not apply (a quantized KV cache, the kernel turned off). A stale build
lock in a fresh build: tests/integration/test_cpu_kernel_builds.py."""

from __future__ import annotations

import pytest
import torch

from mlc.layers import attention, cpu_kernels
from mlc.layers.attention import GroupKind, build_attention_metadata
from mlc.layers.kv_store import PagedTensor
from tests.support.kernel_marks import CPU_KERNELS

H, KV, D, PAGE = 9, 3, 64, 16
CONTEXTS = [37, 120, 5, 300, 64, 77, 250, 16, 2]

pytestmark = CPU_KERNELS


def paged(dtype, contexts, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages = sum(-(-c // PAGE) for c in contexts) + 1
    cache = {name: PagedTensor(pages * PAGE, (KV, D), dtype, "cpu") for name in ("k", "v")}
    for t in cache.values():
        t.data.copy_(torch.randn(t.data.shape, generator=g))
    order = (torch.randperm(pages - 1, generator=g) + 1).tolist()  # pages scattered, as after reuse
    tables, used = [], 0
    for c in contexts:
        n = -(-c // PAGE)
        tables.append(order[used:used + n])
        used += n
    q = torch.randn(len(contexts), H, D, generator=g).to(dtype)
    return q, cache, tables


def attend(q, cache, tables, contexts, kernel: bool):
    meta = build_attention_metadata([1] * len(contexts), contexts, tables, PAGE)
    assert all(g.kind is GroupKind.DECODE for g in meta.groups)
    out = torch.empty(len(contexts), H, D, dtype=q.dtype)
    for g in meta.groups:
        if kernel:
            got = attention._decode_in_place(g, q, cache, 0.125)
            assert got is not None
        else:
            g.pages = None  # the SDPA path: gather, pad to KEY_QUANTUM, masked SDPA
            got = attention._group_attention(g, q, None, None, cache, 0.125)
        out[g.tokens] = got.reshape(-1, H, D)
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1.6e-2)])
def test_kernel_matches_the_sdpa_path(dtype, tol):
    q, cache, tables = paged(dtype, CONTEXTS)
    ours, sdpa = attend(q, cache, tables, CONTEXTS, True), attend(q, cache, tables, CONTEXTS, False)
    assert (ours.float() - sdpa.float()).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_is_bit_identical_alone_and_in_any_batch(dtype):
    q, cache, tables = paged(dtype, CONTEXTS, seed=1)
    batch = attend(q, cache, tables, CONTEXTS, True)
    for i, c in enumerate(CONTEXTS):
        alone = attend(q[i : i + 1], cache, tables[i : i + 1], [c], True)
        assert torch.equal(alone[0], batch[i]), (i, c)
    picked = [3, 0, 6]
    some = attend(q[picked], cache, [tables[i] for i in picked], [CONTEXTS[i] for i in picked], True)
    assert torch.equal(some, batch[picked])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_sharing_a_page_table_keep_their_bits(dtype):
    """A sequence's next token and its speculative drafts: one row each over the same pages, each one more token of
    context; each row is what it is alone."""
    q, cache, tables = paged(dtype, [300, 40, 133], seed=2)
    contexts = [296, 297, 298, 299, 300, 40, 130, 131, 133]
    rows = [tables[0]] * 5 + [tables[1]] + [tables[2]] * 3
    q = torch.randn(len(rows), H, D, generator=torch.Generator().manual_seed(3)).to(dtype)
    batch = attend(q, cache, rows, contexts, True)
    for i, c in enumerate(contexts):
        assert torch.equal(attend(q[i : i + 1], cache, rows[i : i + 1], [c], True)[0], batch[i]), (i, c)
    sdpa = attend(q, cache, rows, contexts, False)
    assert (batch.float() - sdpa.float()).abs().max().item() <= (1e-6 if dtype == torch.float32 else 1.6e-2)


def test_quantized_caches_and_other_dtypes_take_the_sdpa_path():
    from mlc.layers.kv_quant import QuantizedPagedTensor

    q, cache, tables = paged(torch.bfloat16, [40])
    meta = build_attention_metadata([1], [40], tables, PAGE)
    (group,) = meta.groups
    assert attention._decode_in_place(group, q.float(), cache, 0.125) is None  # cache bf16, compute fp32
    quantized = {"k": QuantizedPagedTensor.__new__(QuantizedPagedTensor), "v": cache["v"]}
    assert attention._decode_in_place(group, q, quantized, 0.125) is None


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("MLC_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_kernels, "_BUILT", [])  # this process's kernels forgotten: load() reads the environment
    monkeypatch.setattr(cpu_kernels, "_LOADED", {})
    assert cpu_kernels.kernel_status().startswith("torch ops (SDPA decode attention")
    q, cache, tables = paged(torch.float32, [40])
    (group,) = build_attention_metadata([1], [40], tables, PAGE).groups
    assert attention._decode_in_place(group, q, cache, 0.125) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_in_one_pass_equals_the_eager_ops_row_by_row(dtype):
    from mlc.layers.norm import RMSNorm

    norm = RMSNorm(576, 1e-5).to(dtype)
    g = torch.Generator().manual_seed(3)
    norm.weight.data.copy_(torch.randn(576, generator=g))
    x = (torch.randn(9, 576, generator=g) * 3).to(dtype)
    with torch.inference_mode():
        ours = norm(x)
        h = x.float()
        eager = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        assert (ours.float() - eager.float()).abs().max().item() <= 2 * torch.finfo(dtype).eps * eager.abs().max()
        assert all(torch.equal(norm(x[i : i + 1])[0], ours[i]) for i in range(9))  # each row alone
        assert torch.equal(norm(x.view(3, 3, 576)).view(9, 576), ours)  # any leading shape
    x.requires_grad_(True)
    assert norm(x).grad_fn is not None  # training takes the differentiable eager ops

