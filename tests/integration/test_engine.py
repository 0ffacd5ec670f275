"""The engine on the default model: greedy outputs do not depend on batching, chunking, preemption or the prefix
cache; they equal transformers' greedy; pages never leak."""

from __future__ import annotations

import pytest
import torch

from mlc.engine.llm import LLM
from mlc.engine.sampling_params import SamplingParams
from mlc.models.hf_checkpoint import transformers_model
from tests.support.prompts import CHAT_PROMPTS, chat_prompts

NEW = 32
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0)


@pytest.fixture(scope="module")
def base(default_model_dir):
    """One loaded model and tokenizer; each configuration below gets its own engine around them."""
    llm = LLM(str(default_model_dir), max_batch_size=32, enable_prefix_caching=False, kv_cache_memory="256MiB",
              weight_dtype="fp32", max_num_batched_tokens=512)  # parity with transformers; 512: chunking and
    # preemption stay exercised (the defaults are int4 weights and 4096-token steps)
    return llm


def engine_like(base, **overrides) -> LLM:
    from mlc.engine.llm_engine import LLMEngine

    engine = LLMEngine(base.engine.config, model=base.engine.model, tokenizer=base.engine.tokenizer, **overrides)
    return LLM(engine=engine)


@pytest.fixture(scope="module")
def prompts(base):
    return [base.render_chat(m) for m in chat_prompts(32)]


@pytest.fixture(scope="module")
def batched(base, prompts):
    outs = base.generate(prompts, GREEDY)
    assert_no_leak(base)
    return [o.outputs[0].token_ids for o in outs]


def assert_no_leak(llm: LLM) -> None:
    bm = llm.engine.page_manager
    assert bm.num_free_pages == bm.usable_pages
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def test_prompts_are_varied_and_some_are_long(prompts):
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) == 32 and lengths[-1] > 300 and lengths[0] < 40


def test_alone_equals_among_31_others(base, prompts, batched):
    alone = engine_like(base, max_batch_size=1)
    for i in [0, 3, 5, 8, 20]:  # short, Chinese, long, long, short
        assert alone.generate(prompts[i], GREEDY)[0].outputs[0].token_ids == batched[i], f"prompt {i}"
    assert_no_leak(alone)


def test_chunked_prefill_mixed_with_decode_gives_the_same_tokens(base, prompts, batched):
    chunky = engine_like(base, max_num_batched_tokens=64)
    outs = chunky.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == batched
    assert_no_leak(chunky)


def test_without_chunked_prefill_gives_the_same_tokens(base, prompts, batched):
    whole = engine_like(base, enable_chunked_prefill=False, max_num_batched_tokens=2048)
    outs = whole.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == batched


def test_preemption_under_a_small_page_budget_gives_the_same_tokens(base, prompts, batched):
    bytes_per_page = base.engine.cache_plan.bytes_per_page
    tight = engine_like(base, kv_cache_memory=bytes_per_page * 90)
    outs = tight.generate(prompts, GREEDY)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == batched
    assert_no_leak(tight)


def test_prefix_cache_hits_on_the_second_run(base, prompts, batched):
    cached = engine_like(base, enable_prefix_caching=True)
    first = cached.generate(prompts[:8], GREEDY)
    hits_before = cached.engine.page_manager.prefix_hits
    second = cached.generate(prompts[:8], GREEDY)
    stats = cached.engine.stats()
    assert hits_before == 0 or hits_before < stats.prefix_cache_hits
    long_prompt_pages = (len(prompts[5]) - 1) // cached.engine.config.page_size
    assert stats.prefix_cache_hits - hits_before >= long_prompt_pages
    assert sum(o.metrics.num_prefix_hit_tokens for o in second) > 0
    for a, b, ref in zip(first, second, batched[:8]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == ref
    assert_no_leak(cached)


def test_equals_transformers_greedy(base, prompts, batched, default_model_dir):

    hf = transformers_model(default_model_dir).eval()
    eos = base.engine.tokenizer.eos_token_id
    for i in range(len(CHAT_PROMPTS)):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompts[i]]), max_new_tokens=NEW, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos)
        expected = ref[0, len(prompts[i]):].tolist()
        assert batched[i] == expected, f"prompt {i}"


def test_abort_frees_pages_at_once(base, prompts):
    llm = engine_like(base)
    for i in range(6):
        llm.engine.add_request(f"r{i}", prompts[i], GREEDY)
    for _ in range(3):
        llm.engine.step()
    assert llm.engine.page_manager.num_free_pages < llm.engine.page_manager.usable_pages
    for i in range(6):
        out = llm.engine.abort(f"r{i}")
        assert out.finished and out.outputs[0].finish_reason == "abort"
    assert_no_leak(llm)
    assert not llm.engine.has_unfinished()


def test_logit_bias_forces_and_bans_tokens_in_a_batch(base, prompts, batched):
    """+100 on one token makes greedy pick it every step; -100 on greedy's first token makes it never appear; a
    request without a bias in the same batch keeps its greedy tokens."""
    forced, banned = 28, batched[1][0]
    params = [SamplingParams(max_new_tokens=8, temperature=0.0, logit_bias={forced: 100.0}),
              SamplingParams(max_new_tokens=8, temperature=0.0, logit_bias={banned: -100.0}),
              SamplingParams(max_new_tokens=8, temperature=0.0)]
    outs = [o.outputs[0].token_ids for o in base.generate(prompts[:3], params)]
    assert outs[0] == [forced] * 8
    assert banned not in outs[1]
    assert outs[2] == batched[2][:8]
