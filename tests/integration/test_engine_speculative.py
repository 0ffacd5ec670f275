"""Speculative decoding in the engine loop on the tiny random Llama: what plain decoding gives, whatever the drafts
(a stop id, a stop string or the length limit inside an accepted run, a grammar, n samples with logprobs; prompt
lookup or a draft model), and sampling whose distribution is plain sampling's."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from mlc.config.engine_config import EngineConfig
from mlc.engine.grammar import GrammarSpec
from mlc.engine.llm import LLM
from mlc.engine.llm_engine import LLMEngine
from mlc.engine.sampling_params import SamplingParams
from tests.support.tiny_llama import build_tiny_llama

SPEC = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "disable_by_batch_size": None}  # drafts in batches of any size
PROMPT = [5, 40, 77, 3, 9, 12, 5, 40, 77]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    path = build_tiny_llama(tmp_path_factory.mktemp("tiny") / "m")
    plain = LLMEngine(EngineConfig(model=str(path)), kv_cache_memory="2MiB", page_size=4, max_batch_size=256)
    spec = LLMEngine(plain.config, model=plain.model, tokenizer=plain.tokenizer, speculative_config=SPEC)
    return LLM(engine=plain), LLM(engine=spec)


def outputs(llm: LLM, params: SamplingParams, prompts=(PROMPT,)) -> list:
    return [c for o in llm.generate(list(prompts), params) for c in o.outputs]


def same(a, b) -> None:
    assert [(c.token_ids, c.text, c.finish_reason) for c in a] == [(c.token_ids, c.text, c.finish_reason) for c in b]


def test_a_stop_inside_an_accepted_run_ends_where_plain_decoding_ends(engines):
    plain, spec = engines
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    greedy = outputs(plain, free)[0]
    predicted = dataclasses.replace(free, prediction=list(greedy.token_ids))  # every draft is right
    before = spec.engine.speculator.snapshot().accepted
    same(outputs(spec, predicted), [greedy])
    assert spec.engine.speculator.snapshot().accepted - before >= 20  # most tokens came in accepted runs
    cases = [
        dict(stop_token_ids=[greedy.token_ids[9]]),
        dict(stop=[greedy.text[len(greedy.text) // 2 : len(greedy.text) // 2 + 2]]),
        dict(stop=[greedy.text[len(greedy.text) // 3 : len(greedy.text) // 3 + 2]], include_stop_str_in_output=True),
        dict(max_tokens=13),
        dict(logprobs=3, n=1),
    ]
    for extra in cases:
        params = dataclasses.replace(predicted, **{k: v for k, v in extra.items() if k != "max_tokens"})
        if "max_tokens" in extra:
            params.max_new_tokens = extra["max_tokens"]
        want = outputs(plain, dataclasses.replace(params, prediction=None, speculative=False))
        got = outputs(spec, params)
        same(got, want)
        if params.logprobs is not None:  # fp32 GEMMs round the last bits by batch shape, as any batch does
            assert [lp.token_id for lp in got[0].logprobs] == [lp.token_id for lp in want[0].logprobs]
            assert [lp.logprob for lp in got[0].logprobs] == pytest.approx([lp.logprob for lp in want[0].logprobs],
                                                                          abs=1e-5)


def test_grammar_and_n_samples_decode_as_without_drafts(engines):
    plain, spec = engines
    regex = GrammarSpec("regex", r"([a-c]{2}!){3,8}")
    params = SamplingParams(max_tokens=40, temperature=0.0, grammar=regex)
    want = outputs(plain, params)
    text = want[0].text
    guided = dataclasses.replace(params, prediction=plain.engine.encode(text + text, add_special_tokens=False))
    same(outputs(spec, guided), want)
    seeded = SamplingParams(max_tokens=30, temperature=0.8, seed=7, n=3, logprobs=1)
    prompts = [PROMPT, PROMPT[:4] * 3]
    same(outputs(spec, seeded, prompts), outputs(plain, seeded, prompts))  # one draw a token, drafted or not


@pytest.fixture(scope="module")
def with_draft_model(engines):
    """The tiny model drafting for itself (a separate copy, loaded from its checkpoint as a user's draft is)."""
    plain = engines[0].engine
    spec = {"method": "draft_model", "model": str(plain.model.model_dir), "num_speculative_tokens": 4,
            "disable_by_batch_size": None}
    return LLM(engine=LLMEngine(plain.config, model=plain.model, tokenizer=plain.tokenizer, speculative_config=spec))


def test_a_draft_model_changes_no_output(engines, with_draft_model):
    """Stops, the length limit, logprobs, a grammar (the draft's unconstrained guesses are cut where the grammar
    forbids them) and seeded samples: what plain decoding gives."""
    plain, draft = engines[0], with_draft_model
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    greedy = outputs(plain, free)[0]
    before = draft.engine.speculator.snapshot().accepted
    same(outputs(draft, free), [greedy])
    assert draft.engine.speculator.snapshot().accepted - before >= 20  # a model drafting for itself is right
    cases = [
        dataclasses.replace(free, stop_token_ids=[greedy.token_ids[9]]),
        dataclasses.replace(free, stop=[greedy.text[len(greedy.text) // 2 : len(greedy.text) // 2 + 2]]),
        SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=40, temperature=0.0, grammar=GrammarSpec("regex", r"([a-c]{2}!){3,8}")),
        SamplingParams(max_tokens=30, temperature=0.8, seed=7, n=3, logprobs=1),
    ]
    for params in cases:
        got, want = outputs(draft, params, [PROMPT, PROMPT[:4] * 3]), outputs(plain, params, [PROMPT, PROMPT[:4] * 3])
        same(got, want)
        if params.logprobs is not None:
            assert [[lp.token_id for lp in c.logprobs] for c in got] == [[lp.token_id for lp in c.logprobs]
                                                                         for c in want]
    pm = draft.engine.page_manager
    assert not draft.engine.has_unfinished() and pm.num_free_pages == pm.usable_pages


def _first_tokens(llm: LLM, params: SamplingParams, num: int) -> list[tuple[int, ...]]:
    return [tuple(c.token_ids) for c in outputs(llm, params, [PROMPT] * num)]


def _tv(a: list, b: list) -> float:
    ca, cb = Counter(a), Counter(b)
    return 0.5 * sum(abs(ca[k] / len(a) - cb[k] / len(b)) for k in ca.keys() | cb.keys())


@pytest.mark.slow
def test_sampling_with_drafts_draws_from_the_plain_distribution(engines):
    """Total variation between speculative and plain samples of the first 4 tokens (joint, and each position),
    10,000 samples each, against the distance between two plain runs (the noise)."""
    plain, spec = engines
    torch.manual_seed(0)
    free = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    likely = list(outputs(plain, free)[0].token_ids)
    # the random model's logits lie within a few hundredths of each other: at 0.02 a few sequences carry most of
    # the mass, as a trained model's do at 0.7, so drafts are often right and often wrong
    params = SamplingParams(max_tokens=4, temperature=0.02, ignore_eos=True)
    num = 10_000
    a = _first_tokens(plain, params, num)
    b = _first_tokens(plain, params, num)
    before = spec.engine.speculator.snapshot()
    s = _first_tokens(spec, dataclasses.replace(params, prediction=PROMPT + likely), num)
    after = spec.engine.speculator.snapshot()
    accepted, drafted = after.accepted - before.accepted, after.drafted - before.drafted
    assert drafted > num and 0.1 < accepted / drafted < 0.95  # drafts were both kept and refused, often
    noise = _tv(a, b)
    print(f"TV first 4 tokens: speculative vs plain {_tv(s, a):.4f}, plain vs plain {noise:.4f}; "
          f"{drafted} drafted, {accepted} accepted")
    assert _tv(s, a) < 1.3 * noise + 0.01, (_tv(s, a), noise)
    for j in range(4):
        sj, aj, bj = ([x[j] for x in xs] for xs in (s, a, b))
        assert _tv(sj, aj) < 1.5 * _tv(aj, bj) + 0.01


def test_the_default_model_drafting_for_itself_on_its_fused_path(default_model_dir):
    """The default GGUF serves its decode steps through the fused C++ layers, which must read only the served
    model's cache layers, not the draft model's beside them; and a model drafting for itself is right nearly always."""
    plain = LLM(str(default_model_dir), kv_cache_memory="64MiB")
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = [plain.engine.encode("The quick brown fox"), plain.engine.encode("Rivers run to the sea because")]
    spec = {"method": "draft_model", "model": str(default_model_dir), "num_speculative_tokens": 4}
    draft = LLM(engine=LLMEngine(plain.engine.config, model=plain.engine.model, tokenizer=plain.engine.tokenizer,
                                 speculative_config=spec))
    same(outputs(draft, params, prompts), outputs(plain, params, prompts))
    stats = draft.engine.speculator.snapshot()
    assert stats.drafted > 20 and stats.accepted / stats.drafted > 0.8, stats
