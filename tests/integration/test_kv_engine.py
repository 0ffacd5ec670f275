"""KV-cache dtypes and sparse KV on the default model: fp32 KV with sparse off (configured but not reached, or
opted out per request) leaves greedy outputs exactly as transformers' greedy; int8/int4 stay close; sparse KV
compacts, frees pages, survives preemption and forks, and leaks no page."""

from __future__ import annotations

import pytest
import torch

from mlc.bench import quality
from mlc.config.engine_config import SparseKVConfig
from mlc.engine.llm import LLM
from mlc.engine.llm_engine import LLMEngine
from mlc.engine.sampling_params import SamplingParams
from mlc.models.hf_checkpoint import transformers_model
from tests.support.prompts import CHAT_PROMPTS

NEW = 16
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0)
SPARSE = SparseKVConfig(window=32, ratio=0.25, min_context=64, sink_tokens=4)


@pytest.fixture(scope="module")
def base(default_model_dir):
    return LLM(str(default_model_dir), max_batch_size=8, enable_prefix_caching=False, kv_cache_memory="64MiB",
               weight_dtype="fp32", max_num_batched_tokens=512)  # parity with transformers, as before the int4
    # and 4096-token-step defaults


def engine_like(base, **overrides) -> LLM:
    engine = LLMEngine(base.engine.config, model=base.engine.model, tokenizer=base.engine.tokenizer, **overrides)
    return LLM(engine=engine)


def assert_no_leak(llm: LLM) -> None:
    bm = llm.engine.page_manager
    assert bm.num_free_pages == bm.usable_pages
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


@pytest.fixture(scope="module")
def chat_prompts(base):
    return [base.render_chat(m) for m in CHAT_PROMPTS[:2]]


@pytest.fixture(scope="module")
def long_prompts(base):
    return quality.agreement_prompts(base, n=2, length=160)


@pytest.fixture(scope="module")
def long_greedy(base, long_prompts):
    """fp32 full-KV greedy continuations of the long prompts (the plain engine, as before this feature)."""
    return [o.outputs[0].token_ids for o in engine_like(base).generate(long_prompts, GREEDY)]


@pytest.fixture(scope="module")
def hf_greedy(chat_prompts, default_model_dir, base):

    hf = transformers_model(default_model_dir).eval()
    eos = base.engine.tokenizer.eos_token_id
    outs = []
    for p in chat_prompts:
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos)
        outs.append(ref[0, len(p):].tolist())
    return outs


def test_fp32_kv_and_sparse_kv_below_min_context_equal_transformers_greedy(base, chat_prompts, hf_greedy):
    plain = engine_like(base, kv_cache_dtype="fp32")
    sparse = engine_like(base, kv_cache_dtype="fp32", sparse_kv=SparseKVConfig(window=32, min_context=512))
    assert max(len(p) for p in chat_prompts) + NEW <= 512
    for llm in (plain, sparse):
        assert [o.outputs[0].token_ids for o in llm.generate(chat_prompts, GREEDY)] == hf_greedy
        assert_no_leak(llm)
    assert sparse.engine.sparse.num_compactions == 0


def test_a_full_kv_request_on_a_sparse_engine_is_exact(base, long_prompts, long_greedy):
    sparse = engine_like(base, sparse_kv=SPARSE)
    full = SamplingParams(max_new_tokens=NEW, temperature=0.0, full_kv=True)
    assert [o.outputs[0].token_ids for o in sparse.generate(long_prompts, full)] == long_greedy
    assert sparse.engine.sparse.num_compactions == 0
    assert_no_leak(sparse)


def test_quantized_kv_stays_close_to_fp32(base, long_prompts, long_greedy):
    """Bounds from measurement (kv_quant.py): mean |logprob change| int8 ~0.02, int4 ~0.2 on Genesis."""
    text = quality.long_text_ids(base, 256)
    ref = quality.score_text(engine_like(base, kv_cache_dtype="fp32"), text, chunk=128).logprobs
    for dtype, lp_tol, ppl_tol in (("int8", 0.04, 0.015), ("int4", 0.35, 0.10)):
        llm = engine_like(base, kv_cache_dtype=dtype)
        got = quality.score_text(llm, text, chunk=128).logprobs
        mean_diff = sum(abs(a - b) for a, b in zip(got, ref)) / len(ref)
        ppl_ratio = quality.perplexity_of(got) / quality.perplexity_of(ref)
        agree = quality.greedy_agreement(llm, long_prompts, long_greedy, NEW)
        print(f"[kv {dtype}] mean |d logprob| {mean_diff:.4f}, ppl ratio {ppl_ratio:.4f}, agreement {agree:.2f}")
        assert 0 < mean_diff < lp_tol and abs(ppl_ratio - 1) < ppl_tol, dtype
        assert dtype == "int4" or agree >= 0.5
        assert_no_leak(llm)


def test_sparse_kv_compacts_and_frees_pages_without_leaks(base, long_prompts):
    llm = engine_like(base, sparse_kv=SPARSE)
    engine = llm.engine
    for i, p in enumerate(long_prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    most_held = 0
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            assert seq.num_cache_entries <= SPARSE.min_context or seq.num_cache_entries < seq.num_cached
            assert len(seq.page_table) == engine.page_manager.pages_for(seq.num_cache_entries)
        most_held = max(most_held, engine.page_manager.usable_pages - engine.page_manager.num_free_pages)
    assert engine.sparse.num_compactions >= len(long_prompts) and engine.sparse.pages_freed > 0
    dense_pages = sum(engine.page_manager.pages_for(len(p) + NEW) for p in long_prompts)
    assert most_held < dense_pages
    assert_no_leak(llm)


def test_a_preempted_compacted_sequence_is_recomputed_from_its_tokens(base, long_prompts):
    llm = engine_like(base, sparse_kv=SPARSE)
    engine = llm.engine
    engine.add_request("r", long_prompts[0], GREEDY)
    seq = engine.outputs.requests["r"].seqs[0]
    while not (seq.output_ids and seq.num_cache_entries < seq.num_cached):
        engine.step()
    before = list(seq.output_ids)
    engine.scheduler.preempt(seq)  # what running out of pages does: pages freed, back to the queue
    assert seq.kv_positions is None and seq.num_cached == 0 and not seq.page_table
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    tokens = outs[-1].outputs[0].token_ids
    assert len(tokens) == NEW and tokens[: len(before)] == before and outs[-1].metrics.num_preemptions == 1
    assert engine.sparse.num_compactions >= 2  # compacted again while recomputing
    assert_no_leak(llm)


def test_sparse_kv_with_forked_samples(base, long_prompts):
    """The prompt is compacted between prefill chunks, then its pages are shared by the 3 samples (left alone)."""
    llm = engine_like(base, sparse_kv=SPARSE, max_num_batched_tokens=64)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.8, seed=1, n=3)
    out = llm.generate(long_prompts[0], params)[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == NEW for c in out.outputs)
    assert llm.engine.sparse.num_compactions > 0
    assert_no_leak(llm)


def test_quality_harness_builds_exact_prompts_and_defines_agreement_by_prefix(base):
    trials = quality.needle_trials(base, contexts=(512, 1024), trials=3, seed=7)
    assert [len(t.prompt_ids) for t in trials] == [512] * 3 + [1024] * 3
    assert [t.depth for t in trials[:3]] == [0.1, 0.5, 0.9]
    for t in trials:
        text = base.tokenizer.decode(t.prompt_ids)
        assert f"The secret code is {t.code}." in text and text.endswith("The secret code is")
    assert quality.agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]]) == 4 / 6  # nothing after a divergence
    assert len(quality.agreement_prompts(base, n=4, length=100)) == 4


def test_bench_kv_command_reports_exact_memory_and_capacity(tmp_path):
    import json

    import typer
    from typer.testing import CliRunner

    from mlc.cli.bench.kv import register
    from mlc.errors import ConfigError

    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    result = CliRunner().invoke(app, ["kv", "--no-quality", "--dtypes", "fp32,int4", "--ratios", "1,0.25",
                                      "-o", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = {(r["dtype"], r["ratio"]): r for r in json.loads((tmp_path / "kv.json").read_text())["rows"]}
    assert rows[("fp32", 1.0)]["bytes_per_token"] == 30 * 2 * 3 * 64 * 4
    assert rows[("int4", 1.0)]["bytes_per_token"] == 30 * 2 * 3 * 40
    assert rows[("fp32", 1.0)]["max_sequences"] == 2  # 1 GiB / (8192 tokens x 46080 B) = 2.8
    assert rows[("fp32", 0.25)]["max_sequences"] > 2 * rows[("fp32", 1.0)]["max_sequences"]
    assert rows[("int4", 0.25)]["max_sequences"] > 5 * rows[("fp32", 1.0)]["max_sequences"]
    bad = CliRunner().invoke(app, ["kv", "--no-quality", "--dtypes", "int3"])
    assert isinstance(bad.exception, ConfigError) and "int3" in str(bad.exception)
