"""Engine supervision: a failing step ends only the requests that fail (finish_reason "error", an error that says
so), the engine audits and repairs its state and keeps serving; beyond repair it raises EngineDeadError."""

from __future__ import annotations

import pytest

from mlc.config.engine_config import EngineConfig
from mlc.engine import recovery
from mlc.engine.llm_engine import LLMEngine
from mlc.engine.sampling_params import SamplingParams
from mlc.errors import EngineDeadError, EngineStepError
from tests.support.tiny_llama import build_tiny_llama

POISON = 7  # a prompt holding this token makes the faulty runner raise
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = {"a": [5, 9, 33, 70, 12, 8, 41, 42, 43], "b": [100, 3, 44, 45], "c": [11, 12, 13, 14, 15, 16, 17, 18] * 3}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("recovery") / "model")
    return LLMEngine(EngineConfig(model=str(model_dir)), kv_cache_memory="2MiB")


def fresh(base, **kw) -> LLMEngine:
    return LLMEngine(base.config, model=base.model, tokenizer=base.tokenizer, **kw)


def poison_runner(engine: LLMEngine, when=lambda seqs: any(POISON in s.seq.prompt_ids for s in seqs)):
    run = engine.runner.run

    def faulty(scheduled):
        if when(scheduled):
            raise RuntimeError("injected fault")
        return run(scheduled)

    engine.runner.run = faulty


def run_all(engine: LLMEngine, prompts: dict[str, list[int]], params=GREEDY) -> dict:
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in finals, "a request ended twice"
            if out.finished:
                finals[out.request_id] = out
    assert engine.recovery.audit() == []
    assert engine.page_manager.num_free_pages == engine.page_manager.usable_pages
    return finals


@pytest.fixture(scope="module")
def clean(base):
    return {rid: out.outputs[0].token_ids for rid, out in run_all(fresh(base), PROMPTS).items()}


def test_a_poisoned_request_fails_alone_and_the_rest_are_untouched(base, clean):
    engine = fresh(base)
    poison_runner(engine)
    finals = run_all(engine, {**PROMPTS, "bad": [1, 2, POISON, 4]})
    bad = finals.pop("bad")
    assert bad.outputs[0].finish_reason == "error" and isinstance(bad.error, EngineStepError)
    assert "injected fault" in bad.error.message and "keeps serving other requests" in bad.error.message
    assert {rid: out.outputs[0].token_ids for rid, out in finals.items()} == clean
    assert all(out.error is None for out in finals.values())
    assert run_all(engine, {"after": PROMPTS["a"]})["after"].outputs[0].token_ids == clean["a"]


def test_a_whole_step_failing_ends_its_requests_and_the_engine_goes_on(base, clean):
    engine = fresh(base)
    calls = {"n": 0}

    def third_call(_):
        calls["n"] += 1
        return calls["n"] == 3

    poison_runner(engine, third_call)
    engine.add_request("x", PROMPTS["a"], GREEDY)
    ended = []
    while engine.has_unfinished():
        ended += [o for o in engine.step() if o.finished]
    assert [o.outputs[0].finish_reason for o in ended] == ["error"] and engine.recovery.consecutive_failures == 1
    assert run_all(engine, PROMPTS) and engine.recovery.consecutive_failures == 0  # a good step resets the count


def test_corrupted_accounting_is_rebuilt_and_sequences_recomputed(base, clean):
    engine = fresh(base)
    bm = engine.page_manager

    def corrupt(scheduled):
        if any(POISON in s.seq.prompt_ids for s in scheduled):
            bm.ref[bm.free_plain[0]] = 5  # a leaked reference: the audit must catch it
            return True
        return False

    poison_runner(engine, corrupt)
    finals = run_all(engine, {**PROMPTS, "bad": [POISON, 2, 3]})
    assert finals.pop("bad").outputs[0].finish_reason == "error"
    assert {rid: out.outputs[0].token_ids for rid, out in finals.items()} == clean  # recomputed from their tokens


def test_steps_failing_in_a_row_on_different_prompts_declare_the_engine_dead(base):
    engine = fresh(base)
    poison_runner(engine, lambda _: True)
    with pytest.raises(EngineDeadError, match="3 engine steps failed in a row on different prompts"):
        for i in range(recovery.MAX_CONSECUTIVE_FAILURES):
            engine.add_request(f"r{i}", [*PROMPTS["b"], i], GREEDY)
            engine.step()


def test_one_poison_prompt_sent_again_and_again_does_not_kill_the_engine(base, clean):
    engine = fresh(base)
    poison_runner(engine)
    for i in range(2 * recovery.MAX_CONSECUTIVE_FAILURES):  # alone in its step each time: a whole-step failure
        engine.add_request(f"bad{i}", [1, 2, POISON], GREEDY)
        assert [o.outputs[0].finish_reason for o in engine.step()] == ["error"]
    assert engine.recovery.consecutive_failures == 2 * recovery.MAX_CONSECUTIVE_FAILURES
    assert run_all(engine, {"a": PROMPTS["a"]})["a"].outputs[0].token_ids == clean["a"]


def test_a_row_that_fails_to_sample_ends_only_its_request(base, clean, monkeypatch):
    engine = fresh(base)
    draw = engine.sampler.__class__.__call__

    def picky(self, logits, seqs):
        if any(POISON in s.prompt_ids for s in seqs):
            raise RuntimeError("invalid multinomial distribution")
        return draw(self, logits, seqs)

    monkeypatch.setattr(engine.sampler.__class__, "__call__", picky)
    finals = run_all(engine, {**PROMPTS, "bad": [POISON, 3, 4]})
    assert finals.pop("bad").outputs[0].finish_reason == "error"
    assert {rid: out.outputs[0].token_ids for rid, out in finals.items()} == clean


def test_an_unrepairable_state_declares_the_engine_dead(base, monkeypatch):
    engine = fresh(base)
    poison_runner(engine)
    monkeypatch.setattr(engine.recovery, "audit", lambda: ["page 3: reference count 2, held by 1"])
    engine.add_request("bad", [POISON], GREEDY)
    with pytest.raises(EngineDeadError, match="could not be repaired"):
        engine.step()
