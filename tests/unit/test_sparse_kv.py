"""Sparse KV: the keep rule, compaction in a sequence's own pages (pages freed, sinks and window bit-identical, shared
pages untouched, prefix cache kept honest), the admission bound, and exact next-token logits after compaction."""

from __future__ import annotations

import logging

import pytest
import torch

from mlc.config.engine_config import SparseKVConfig
from mlc.engine.kv_cache import KVCache
from mlc.engine.model_runner import ModelRunner
from mlc.engine.page_manager import PageManager
from mlc.engine.sampling_params import SamplingParams
from mlc.engine.sequence import ScheduledSeq, Sequence
from mlc.engine.sparse_kv import SparseKV, SparseKVPolicy, entry_positions
from mlc.layers.attention import build_attention_metadata

PS = 4
CFG = SparseKVConfig(window=16, ratio=0.25, min_context=32, sink_tokens=2)
SPEC = [{"k": (2, 8), "v": (2, 8)}, {"latent": (12,)}]


def new_seq(n: int, **params) -> Sequence:
    return Sequence("r", list(range(n)), SamplingParams(**params))


def slots_of(seq: Sequence, entries: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(seq.page_table)
    return table[entries // PS] * PS + entries % PS


class Fixture:
    """A cache, its allocator and the sparse policy; `feed` runs a sequence's tokens in chunks like the engine,
    writing a known row per position and compacting between chunks."""

    def __init__(self, dtype=torch.float32, num_pages: int = 64, prefix_caching: bool = False, cfg=CFG):
        self.cache = KVCache(SPEC, num_pages, PS, dtype)
        self.bm = PageManager(num_pages, PS, prefix_caching)
        self.sparse = SparseKV(cfg, self.bm, self.cache)
        gen = torch.Generator().manual_seed(0)
        self.values = {
            (i, n): torch.randn(512, *s, generator=gen) for i, layer in enumerate(SPEC) for n, s in layer.items()
        }
        self.stored: dict[tuple[int, str], dict[int, torch.Tensor]] = {key: {} for key in self.values}

    def feed(self, seq: Sequence, upto: int, chunk: int = 8) -> int:
        freed = 0
        while seq.num_cached < upto:
            k = min(chunk, upto - seq.num_cached)
            for c in self.bm.grow(seq, seq.num_cache_entries + k):  # copy-on-write, as the runner does
                src, dst = torch.arange(c.num_entries) + c.src * PS, torch.arange(c.num_entries) + c.dst * PS
                for layer in self.cache.layers:
                    for store in layer.values():
                        store.copy_slots(src, dst)
            slots = slots_of(seq, torch.arange(seq.num_cache_entries, seq.num_cache_entries + k))
            pos = torch.arange(seq.num_cached, seq.num_cached + k)
            for (i, name), vals in self.values.items():
                store = self.cache.layers[i][name]
                store.write(slots, vals[pos])
                for p, row in zip(pos.tolist(), store.gather(slots, torch.float32)):
                    self.stored[(i, name)][p] = row  # what the store holds for p (quantized: after rounding)
            seq.num_cached += k
            seq.num_cache_entries += k
            self.bm.register_full_pages(seq)
            freed += self.sparse.compact([seq])
        return freed

    def assert_entries_exact(self, seq: Sequence) -> list[int]:
        positions = entry_positions(seq).tolist()
        slots = slots_of(seq, torch.arange(len(positions)))
        for (i, name), rows in self.stored.items():
            got = self.cache.layers[i][name].gather(slots, torch.float32)
            want = torch.stack([rows[p] for p in positions])
            assert torch.equal(got, want), (i, name)
        return positions


def test_keep_rule_is_strided_keeps_sinks_and_is_idempotent():
    policy = SparseKVPolicy(CFG, PS)
    pos = torch.arange(102)
    kept = pos[policy.keeps(pos)].tolist()
    assert kept[:2] == [0, 1] and kept[2:] == list(range(5, 102, 4))  # one in 4 past the 2 sinks
    assert bool(policy.keeps(torch.tensor(kept)).all())  # thinning thinned context changes nothing
    third = SparseKVPolicy(SparseKVConfig(window=16, ratio=0.3, sink_tokens=0), PS)
    picked = pos[third.keeps(pos)]
    assert abs(len(picked) - 0.3 * 102) <= 1 and int(picked.diff().max()) <= 4


def test_plan_waits_for_min_context_and_a_page_worth_of_savings():
    policy = SparseKVPolicy(CFG, PS)
    assert policy.plan(torch.arange(32), 32, 0) is None  # not past min_context
    assert policy.plan(torch.arange(22), 40, 0) is None  # 4 entries older than the window free 3 < a page
    kept = policy.plan(torch.arange(40), 40, 0)
    assert kept.tolist() == [0, 1, 5, 9, 13, 17, 21] + list(range(24, 40))
    assert policy.plan(torch.arange(40), 40, first_mutable=20) is None  # shared pages up to entry 20 stay


def test_compaction_frees_pages_and_keeps_sinks_window_and_positions():
    for dtype in (torch.float32, "int4"):
        fx = Fixture(dtype)
        seq = new_seq(200)
        free_before = fx.bm.num_free_pages
        freed = fx.feed(seq, 200)
        assert freed > 0 and fx.sparse.num_compactions >= 2
        assert seq.num_cached == 200 and seq.num_cache_entries < 200 - 3 * 32
        assert len(seq.page_table) == fx.bm.pages_for(seq.num_cache_entries)
        assert fx.bm.num_free_pages == free_before - len(seq.page_table)
        positions = fx.assert_entries_exact(seq)  # every kept entry bit-identical, at its original position
        assert positions[:2] == [0, 1]
        assert positions[-CFG.window:] == list(range(200 - CFG.window, 200))
        policy = fx.sparse.policy
        assert bool(policy.keeps(torch.tensor(positions[: -CFG.window])).all())  # old part: exactly the rule's
        fx.bm.free(seq)
        assert fx.bm.num_free_pages == fx.bm.usable_pages and seq.kv_positions is None


def test_pages_shared_with_a_fork_are_left_alone():
    fx = Fixture()
    parent, child = new_seq(200), new_seq(200)
    fx.feed(parent, 30, chunk=30)  # below min_context: dense, 7 full pages and 2 entries in an 8th
    fx.bm.fork(parent, child)
    shared = list(parent.page_table)
    before = {p: fx.cache.layers[0]["k"].data[p * PS : (p + 1) * PS].clone() for p in shared}
    fx.feed(parent, 120)
    assert fx.sparse.num_compactions > 0 and parent.num_cache_entries < 100
    assert parent.page_table[:7] == shared[:7]  # the partly filled 8th was copied on write, as always
    for p in shared:
        assert torch.equal(fx.cache.layers[0]["k"].data[p * PS : (p + 1) * PS], before[p])
    assert entry_positions(parent)[:28].tolist() == list(range(28))  # shared pages are not thinned
    fx.assert_entries_exact(parent)
    for s in (parent, child):
        fx.bm.free(s)
    assert fx.bm.num_free_pages == fx.bm.usable_pages


def test_rewritten_pages_leave_the_prefix_cache():
    fx = Fixture(prefix_caching=True)
    seq = new_seq(200)
    fx.feed(seq, 32, chunk=32)
    assert set(fx.bm.page_key) == set(seq.page_table)  # a dense prompt: every full page is findable
    fx.feed(seq, 100)
    assert fx.sparse.num_compactions > 0
    # compaction rewrites from entry 2 (after the sinks), so from the first page on nothing is findable any more,
    # and a compacted sequence registers nothing new (its entries are no longer its tokens page by page)
    assert fx.bm.page_key == {} and fx.bm.hash_to_page == {}
    again = new_seq(200)
    assert fx.bm.match_prefix(again) == 0
    fx.bm.free(seq)
    assert fx.bm.num_free_pages == fx.bm.usable_pages


def test_admission_bound_covers_the_peak_of_a_growing_sequence():
    for ratio in (0.1, 0.25, 0.5):
        cfg = SparseKVConfig(window=32, ratio=ratio, min_context=64, sink_tokens=4)
        bm = PageManager(400, PS, False)
        sparse = SparseKV(cfg, bm, None)  # pages only
        seq = new_seq(1000)
        peak = 0
        while seq.num_cached < 1000:
            k = min(24, 1000 - seq.num_cached)
            bm.grow(seq, seq.num_cache_entries + k)
            seq.num_cached += k
            seq.num_cache_entries += k
            peak = max(peak, seq.num_cache_entries)
            sparse.compact([seq])
        bound = sparse.policy.max_entries(1000, 24)
        assert peak <= bound < 1000, (ratio, peak, bound)
        assert bound - peak <= 3 * 24 + 64, (ratio, peak, bound)  # and not wildly loose


def test_low_ratio_warns_and_full_kv_requests_are_skipped(caplog):
    with caplog.at_level(logging.WARNING, logger="mlc.engine"):
        SparseKV(SparseKVConfig(ratio=0.1), PageManager(8, PS), None)
    assert "ratio 0.1" in caplog.text
    fx = Fixture()
    seq = new_seq(200, full_kv=True)
    fx.feed(seq, 120)
    assert seq.num_cache_entries == 120 and fx.sparse.num_compactions == 0


# logits after compaction
def randomized_checkpoint(hf, path):
    from mlc.models.loader import load_model

    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    hf.save_pretrained(path)
    return load_model(path)


@pytest.fixture(scope="module", params=["llama", "glm_moe_dsa"])
def tiny_model(request, tmp_path_factory):
    import transformers as tf

    path = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        return randomized_checkpoint(tf.LlamaForCausalLM(cfg).eval(), path)
    # index_topk above the context: DSA keeps every key, so the test is about the latent and index_k entries moving
    cfg = tf.GlmMoeDsaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        n_group=1, topk_group=1, first_k_dense_replace=1, index_topk=512, index_head_dim=16, index_n_heads=2,
        indexer_types=["full", "shared"], max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return randomized_checkpoint(tf.GlmMoeDsaForCausalLM(cfg).eval(), path)


@torch.inference_mode()
def masked_decode(model, cache, seq, token: int, visible: torch.Tensor) -> torch.Tensor:
    """The reference: one decode step over the full cache, attending only to `visible` entries (and itself)."""
    ctx = seq.num_cache_entries + 1
    # generating=[False]: the masked SDPA path (the C++ decode kernel reads the whole context and takes no mask)
    meta = build_attention_metadata([1], [ctx], [seq.page_table], PS, generating=[False])
    group = meta.groups[0]
    width = group.mask.shape[-1]  # the context padded to KEY_QUANTUM (the padding is masked already)
    group.mask = group.mask & torch.cat((visible, torch.ones(width - len(visible), dtype=torch.bool)))
    hidden = model(torch.tensor([token]), torch.tensor([seq.num_cached]), meta, cache.layers)
    return model.compute_logits(hidden)


@pytest.mark.parametrize("dtype", [torch.float32, "int8"], ids=str)
def test_next_token_logits_after_compaction_equal_attending_only_the_kept_tokens(tiny_model, dtype):
    """Prefill 90 tokens in one step (identical KV in both caches), compact one copy, then decode 4 tokens: each
    step's logits equal a decode over the uncompacted cache that masks out the dropped entries, at the same
    (original) positions."""
    prompt = torch.randint(0, 128, (90,), generator=torch.Generator().manual_seed(5)).tolist()
    spec = tiny_model.kv_cache_spec()
    runs = []
    for _ in range(2):
        cache, bm = KVCache(spec, 64, PS, dtype), PageManager(64, PS, False)
        seq = Sequence("r", prompt, SamplingParams())
        bm.grow(seq, 90)
        logits = ModelRunner(tiny_model, cache).run([ScheduledSeq(seq, 90)]).logits
        seq.num_cached = seq.num_cache_entries = 90
        runs.append((cache, bm, seq))
    (cache, bm, seq), (ref_cache, _, ref_seq) = runs
    assert SparseKV(CFG, bm, cache).compact([seq]) > 0
    kept = entry_positions(seq)
    assert len(kept) < 60 and kept[-1] == 89
    visible = torch.zeros(90, dtype=torch.bool)
    visible[kept] = True
    token = int(logits[0].argmax())
    runner = ModelRunner(tiny_model, cache)
    for step in range(4):
        for s, b in ((seq, bm), (ref_seq, runs[1][1])):
            s.output_ids.append(token)
            b.grow(s, s.num_cache_entries + 1)
        got = runner.run([ScheduledSeq(seq, 1)]).logits
        if step == 0:  # (first: the reference decode below rewrites the new token's entries as they should be)
            full = masked_decode(tiny_model, ref_cache, ref_seq, token, torch.ones(90, dtype=torch.bool))
        want = masked_decode(tiny_model, ref_cache, ref_seq, token, visible)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (step, float((got - want).abs().max()))
        if step == 0:
            assert float((full - want).abs().max()) > 1e-3  # dropping entries matters: the check is not vacuous
        for s in (seq, ref_seq):
            s.num_cached += 1
            s.num_cache_entries += 1
        visible = torch.cat((visible, torch.ones(1, dtype=torch.bool)))
        token = int(want[0].argmax())
