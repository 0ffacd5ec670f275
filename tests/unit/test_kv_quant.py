"""Quantized KV stores: round-trip error bounds relative to each group's range, int4 packing, exact bytes per token,
slot moves bit for bit, and GLM-5's latent / indexer caches under every KV dtype."""

from __future__ import annotations

import pytest
import torch

from mlc.engine.kv_cache import KVCache
from mlc.layers.kv_quant import FORMATS, QuantFormat, QuantizedPagedTensor, dequantize, new_paged_tensor, quantize
from mlc.layers.kv_store import PagedTensor

ALL_FORMATS = [QuantFormat(8, 64, True), QuantFormat(8, 64, False), QuantFormat(4, 32, True), QuantFormat(4, 32, False)]
SMOLLM_SPEC = [{"k": (3, 64), "v": (3, 64)} for _ in range(30)]  # SmolLM2-135M: 30 layers, 3 KV heads of 64


def sample_rows(last: int, seed: int = 0) -> torch.Tensor:
    """Rows of very different scales, some with an outlier and some off-centre (like cached keys)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 3, last, generator=gen)
    x *= torch.logspace(-3, 3, 64)[:, None, None]
    x[::5, :, 3] *= 40.0
    x[1::3] += 2.0 * x[1::3].abs().amax(-1, keepdim=True)
    return x


def grouped(x: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    groups, size = fmt.layout(x.shape[-1])
    pad = groups * size - x.shape[-1]
    return torch.nn.functional.pad(x, (0, pad)).reshape(*x.shape[:-1], groups, size)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=str)
@pytest.mark.parametrize("last", [64, 40, 7])
def test_round_trip_error_is_at_most_half_a_step_of_its_group(fmt, last):
    x = sample_rows(last)
    y = dequantize(*quantize(x, fmt), fmt, last, torch.float32)
    err = grouped((y - x).abs(), fmt)
    g = grouped(x, fmt)
    if fmt.symmetric:
        step = g.abs().amax(-1, keepdim=True) / ((1 << (fmt.bits - 1)) - 1)
        slack = 0.0
    else:
        step = (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / fmt.levels
        slack = g.amin(-1, keepdim=True).abs() * 2.0**-11  # the minimum is stored in fp16
    step = step.clamp(min=2.0**-14)  # the documented floor: scales are at least fp16's smallest normal
    bound = step / 2 * (1 + 2.0**-9) + slack
    assert bool((err <= bound).all()), float((err / bound).max())
    assert float(err.max()) > 0  # the bound is not vacuous: this data does not happen to be exact


def test_asymmetric_int4_beats_symmetric_on_off_centre_rows():
    x = sample_rows(64)[1::3]
    errs = {}
    for sym in (True, False):
        fmt = QuantFormat(4, 32, sym)
        errs[sym] = float(((dequantize(*quantize(x, fmt), fmt, 64, torch.float32) - x) ** 2).mean())
    assert errs[False] < 0.5 * errs[True]


@pytest.mark.parametrize("sym", [True, False])
def test_int4_packing_is_exact_on_representable_values(sym):
    """Values on the quantization grid come back bit for bit: two codes a byte, low nibble first, in order."""
    fmt = QuantFormat(4, 32, sym)
    codes = torch.randint(0, 16, (5, 2, 64), generator=torch.Generator().manual_seed(1))
    codes[..., 0], codes[..., 31] = 0, 15  # fix each group's range
    codes[..., 32], codes[..., 63] = 0, 15
    if sym:
        codes = codes.clamp(1, 15)  # symmetric codes are offset by 8 and span -7..7
        codes[..., 0] = codes[..., 32] = 1
        x = (codes - 8).float() * 0.25
    else:
        x = codes.float() * 0.5 - 3.0
    packed, params = quantize(x, fmt)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 2, 32)
    assert torch.equal(packed[..., 0] & 0xF, codes[..., 0].to(torch.uint8))
    assert torch.equal(packed[..., 0] >> 4, codes[..., 1].to(torch.uint8))
    assert torch.equal(dequantize(packed, params, fmt, 64, torch.float32), x)


def test_bytes_per_token_is_exact_for_every_dtype():
    # per head row of 64: fp32 256 B, fp16/bf16 128, int8 64 codes + 2 fp16 scales, int4 32 + 2 x (scale, min)
    rows = 30 * 2 * 3
    want = {torch.float32: 256, torch.float16: 128, torch.bfloat16: 128, "int8": 68, "int4": 40}
    for dtype, per_row in want.items():
        assert KVCache.bytes_per_token_for(SMOLLM_SPEC, dtype) == rows * per_row
        assert KVCache.layer_bytes_per_token_for(SMOLLM_SPEC, dtype) == [2 * 3 * per_row] * 30
    cache = KVCache(SMOLLM_SPEC[:2], num_pages=3, page_size=4, dtype="int4")
    k = cache.layers[0]["k"]
    assert cache.bytes_per_token() == 2 * 2 * 3 * 40
    assert k.data.numel() + 2 * k.params.numel() == 3 * 4 * 3 * 40  # what is allocated is what is reported
    # MLA latent of 40 (int4: 2 groups of 20) and index_k of 16 (1 group)
    assert new_paged_tensor(1, (40,), "int4", "meta").bytes_per_token() == 20 + 2 * 2 * 2
    assert new_paged_tensor(1, (16,), "int8", "meta").bytes_per_token() == 16 + 2
    assert new_paged_tensor(1, (576,), "int8", "meta").bytes_per_token() == 576 + 18 * 2  # GLM-5's real latent


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, "int8", "int4"], ids=str)
def test_store_write_gather_and_copy_slots(dtype):
    store = new_paged_tensor(32, (3, 64), dtype, "cpu")
    assert isinstance(store, QuantizedPagedTensor) == isinstance(dtype, str)
    x = sample_rows(64)[32:40]  # magnitudes 1 to 100, well above the scale floor
    slots = torch.tensor([3, 9, 10, 11, 20, 21, 30, 31])
    store.write(slots, x)
    got = store.gather(slots, torch.float32)
    tol = {torch.float32: 0, torch.float16: 1e-3, torch.bfloat16: 1e-2, "int8": 1e-2, "int4": 0.2}[dtype]
    assert got.dtype == torch.float32 and got.shape == (8, 3, 64)
    assert float((got - x).abs().max()) <= tol * float(x.abs().max())
    store.copy_slots(slots[4:], torch.tensor([0, 1, 2, 4]))
    assert torch.equal(store.gather(torch.tensor([0, 1, 2, 4]), torch.float32), got[4:])  # bit for bit
    store.clear(slice(0, 3))
    assert torch.equal(store.gather(torch.tensor([[0, 1, 2]]), torch.float32), torch.zeros(1, 3, 3, 64))


def test_null_page_reads_zero_in_quantized_caches():
    for dtype in ("int8", "int4"):
        cache = KVCache(SMOLLM_SPEC[:1], num_pages=2, page_size=4, dtype=dtype)
        assert torch.equal(cache.layers[0]["v"].gather(torch.arange(4), torch.float32), torch.zeros(4, 3, 64))


def test_engine_formats_are_the_documented_ones():
    assert FORMATS["int8"] == QuantFormat(8, 32, True) and FORMATS["int4"] == QuantFormat(4, 32, False)
    with pytest.raises(ValueError, match="int8"):
        new_paged_tensor(1, (4,), "int2", "cpu")
    assert isinstance(new_paged_tensor(1, (4,), torch.float16, "cpu"), PagedTensor)


# GLM-5 (MLA latent + DSA indexer keys) under every KV dtype
@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    from mlc.models.loader import load_model

    cfg = GlmMoeDsaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        index_topk=4, index_head_dim=16, index_n_heads=2, indexer_types=["full", "shared", "full"],
        max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = GlmMoeDsaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    path = tmp_path_factory.mktemp("glm5")
    hf.save_pretrained(path)
    return load_model(path)


@torch.inference_mode()
def paged_logits(model, tokens: list[int], dtype, prefill: int = 9, page_size: int = 4) -> torch.Tensor:
    """Prefill, then one token a step through a paged cache of `dtype` (DSA sparse past 4 keys)."""
    from mlc.layers.attention import build_attention_metadata

    pages = (len(tokens) + page_size - 1) // page_size + 1
    cache = KVCache(model.kv_cache_spec(), pages, page_size, dtype)
    table = list(range(pages - 1, 0, -1))  # not a contiguous range; page 0 stays the null page
    outs, done = [], 0
    while done < len(tokens):
        n = prefill if done == 0 else 1
        meta = build_attention_metadata([n], [done + n], [table], page_size)
        h = model(torch.tensor(tokens[done : done + n]), torch.arange(done, done + n), meta, cache.layers)
        outs.append(model.compute_logits(h))
        done += n
    return torch.cat(outs)


KV_DTYPES = [torch.float16, torch.bfloat16, "int8", "int4"]
DENSE_TOL = {torch.float16: 0.005, torch.bfloat16: 0.02, "int8": 0.02, "int4": 0.15}  # max row error / max logit
DSA_TOL = {torch.float16: 0.01, torch.bfloat16: 0.02, "int8": 0.02, "int4": 0.25}  # mean row error / max logit


def row_errors(model, tokens, dtype, ref) -> torch.Tensor:
    got = paged_logits(model, tokens, dtype)
    assert torch.isfinite(got).all(), dtype
    return (got - ref).abs().amax(-1) / float(ref.abs().max())


def test_glm5_latent_and_indexer_caches_work_with_every_kv_dtype(glm5, monkeypatch):
    """Against the same steps over an fp32 cache (parity of that with transformers: tests/numerics). With DSA
    selecting 4 of up to 40 keys, a near-tie can swap one key under any narrower cache (bf16 too), so that case
    bounds the mean row error; with selection off (every key attended) the bound is per row."""
    assert glm5.kv_cache_spec()[0] == {"latent": (40,), "index_k": (16,)}
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = paged_logits(glm5, tokens, torch.float32)
    for dtype in KV_DTYPES:
        err = row_errors(glm5, tokens, dtype, ref)
        print(f"[glm5 kv {dtype}, DSA top-4] mean row error {float(err.mean()):.4f}, max {float(err.max()):.4f}")
        assert float(err.mean()) < DSA_TOL[dtype], dtype
    for layer in glm5.model.layers:
        if layer.self_attn.indexer is not None:
            monkeypatch.setattr(layer.self_attn.indexer, "topk", 10**6)
    ref = paged_logits(glm5, tokens, torch.float32)
    for dtype in KV_DTYPES:
        err = row_errors(glm5, tokens, dtype, ref)
        print(f"[glm5 kv {dtype}, all keys] max row error {float(err.max()):.4f}")
        assert float(err.max()) < DENSE_TOL[dtype], dtype
    cache = KVCache(glm5.kv_cache_spec(), 2, 4, "int4")
    assert all(isinstance(t, QuantizedPagedTensor) for layer in cache.layers for t in layer.values())
