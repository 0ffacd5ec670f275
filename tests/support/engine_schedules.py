"""Randomized engine schedules on the tiny random Llama, checked against invariants.

A schedule is a random engine configuration (page size, a KV pool small enough to preempt, token budget, chunked
prefill, prefix caching, sparse KV or speculative decoding, batch size) and a random stream of requests (shared
prefixes, `n`, stop strings and stop ids, max_new_tokens 1..64, prompt logprobs, logprobs, seeds, penalties, a LoRA
adapter, a predicted output) that arrive and are aborted at random steps. After every step the engine's state must
audit clean; at the end:

- every request ended exactly once (one finished output, nothing after it), or was refused at admission;
- no page leaked, and both queues are empty;
- every deterministic request (greedy, or seeded) that was not aborted produced exactly what it produces alone on
  a fresh engine without speculative decoding (a seeded sample too: each emitted token is one draw from the
  request's generator, drafted or not), on dense schedules (on sparse ones, requests with `full_kv`), prompt
  logprobs included; fp32 logits differ in their last bits between batch compositions, so a greedy token may part
  where the two best tokens tie (NEAR_TIE) and a seeded draw where the race between two tokens does (NEAR_TIE_DRAW);
- the `n` samples of a sampled request (seeded or not) differ: each draws from its own generator.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import torch

from mlc.config.engine_config import SparseKVConfig, SpeculativeConfig
from mlc.engine.kv_cache import KVCache
from mlc.engine.llm_engine import LLMEngine
from mlc.engine.sampling_params import SamplingParams
from mlc.errors import InvalidRequestError


@dataclass
class PlannedRequest:
    rid: str
    prompt: list[int]
    params: SamplingParams
    adapter_id: int
    arrive_step: int
    abort_step: int | None


@dataclass
class Outcome:
    outputs: list = field(default_factory=list)
    refused: bool = False
    aborted: bool = False


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    greedy = rng.random() < 0.5
    kw = dict(max_new_tokens=rng.randint(1, 64), temperature=0.0 if greedy else rng.choice([0.5, 1.0, 1.5]),
              n=rng.choice([1, 1, 1, 2, 3]))
    if not greedy and rng.random() < 0.6:
        kw["seed"] = rng.randint(0, 10**6)
    if not greedy and rng.random() < 0.3:
        kw.update(top_k=rng.choice([0, 5, 50]), top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.05]))
    if rng.random() < 0.2:
        kw.update(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3)
    if rng.random() < 0.2:
        kw["stop"] = [rng.choice(["e", "th", "!", "o,"])]
    if rng.random() < 0.15:
        kw["stop_token_ids"] = [rng.randrange(vocab)]
    if rng.random() < 0.2:
        kw["prompt_logprobs"] = True
    if rng.random() < 0.25:
        kw["logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.2:
        kw["min_new_tokens"] = min(kw["max_new_tokens"], rng.randint(0, 4))
    if rng.random() < 0.3:
        kw["ignore_eos"] = True
    if rng.random() < 0.2:
        kw["full_kv"] = True
    if rng.random() < 0.1:
        kw["speculative"] = False
    if rng.random() < 0.1:
        kw["prediction"] = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))] * 2
    if rng.random() < 0.15:
        kw["logit_bias"] = {rng.randrange(vocab): rng.choice([-100.0, -2.0, 3.0])}  # +100 would make n samples equal
    return SamplingParams(**kw)


def random_requests(rng: random.Random, vocab: int, num_adapters: int) -> list[PlannedRequest]:
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(8, 40))] for _ in range(2)]
    reqs = []
    for i in range(rng.randint(2, 10)):
        suffix = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        prompt = (rng.choice(prefixes) + suffix) if rng.random() < 0.5 else suffix
        abort = rng.randint(0, 40) if rng.random() < 0.15 else None
        adapter = rng.randint(0, num_adapters) if rng.random() < 0.3 else 0
        reqs.append(PlannedRequest(f"r{i}", prompt, random_params(rng, vocab), adapter, rng.randint(0, 12), abort))
    return reqs


def random_engine(rng: random.Random, base: LLMEngine, mtp: bool = False, draft: str | None = None) -> LLMEngine:
    """`mtp`: the model has its MTP layer, and a speculative engine drafts with it; `draft`: a speculative engine
    drafts with that draft model (the served model's own checkpoint)."""
    page = rng.choice([4, 8, 16])
    per_token = KVCache.bytes_per_token_for(base.model.stage_cache_spec(), base.kv_cache.dtype)
    if draft is not None:  # the draft model is the served model again: its layers share the pages
        per_token += KVCache.bytes_per_token_for(base.model.kv_cache_spec(), base.kv_cache.dtype)
    sparse = None
    if rng.random() < 0.25:
        sparse = SparseKVConfig(window=16, ratio=rng.choice([0.25, 0.5]), min_context=rng.choice([24, 48]),
                                sink_tokens=2)
    spec = None
    if sparse is None and mtp and rng.random() < 0.7:
        spec = SpeculativeConfig(method="mtp", num_speculative_tokens=rng.choice([1, 1, 2, 3]),
                                 disable_by_batch_size=rng.choice([None, 2, 8]))
    elif sparse is None and draft is not None and rng.random() < 0.7:
        spec = SpeculativeConfig(method="draft_model", model=draft, num_speculative_tokens=rng.choice([1, 3, 6]),
                                 disable_by_batch_size=rng.choice([None, 2, 8]))
    elif sparse is None and not mtp and draft is None and rng.random() < 0.4:
        lo = rng.randint(1, 3)
        spec = SpeculativeConfig(num_speculative_tokens=rng.choice([1, 3, 6]), prompt_lookup_min=lo,
                                 prompt_lookup_max=lo + rng.randint(0, 2),
                                 disable_by_batch_size=rng.choice([None, 2, 8]))
    engine = LLMEngine(
        base.config, model=base.model, tokenizer=base.tokenizer, lora_adapters={}, page_size=page,
        kv_cache_memory=rng.randint(24, 96) * page * per_token, max_batch_size=rng.randint(1, 8),
        max_num_batched_tokens=rng.choice([16, 32, 64, 512]), enable_chunked_prefill=rng.random() < 0.7,
        enable_prefix_caching=rng.random() < 0.7, sparse_kv=sparse, seed=rng.randrange(100),
        speculative_config=spec,
    )
    engine.loras.loaded, engine.loras.by_id = base.loras.loaded, base.loras.by_id  # attached to the shared model
    return engine


def run_schedule(engine: LLMEngine, reqs: list[PlannedRequest], max_steps: int = 5000) -> dict[str, Outcome]:
    outcomes = {r.rid: Outcome() for r in reqs}
    step = 0
    while step < max_steps:
        for r in reqs:
            if r.arrive_step == step:
                try:
                    engine.add_request(r.rid, r.prompt, r.params, r.adapter_id)
                except InvalidRequestError:
                    outcomes[r.rid].refused = True
            if r.abort_step == step and engine.has_request(r.rid):
                outcomes[r.rid].aborted = True
                outcomes[r.rid].outputs.append(engine.abort(r.rid))
        for out in engine.step():
            outcomes[out.request_id].outputs.append(out)
        problems = engine.recovery.audit()
        assert not problems, f"step {step}: {problems}"
        step += 1
        if step > max(r.arrive_step for r in reqs) and not engine.has_unfinished():
            break
    assert not engine.has_unfinished(), f"requests still running after {max_steps} steps"
    return outcomes


@dataclass
class Alone:
    output: object  # the final RequestOutput
    draws: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]  # sample index -> (generator state, probs) per draw


def alone(reference: LLMEngine, r: PlannedRequest, cache: dict) -> Alone:
    """`r` run alone on the reference engine (with the top-2 logprobs of each token, which change no token), and
    what each of its sampled tokens was drawn from."""
    key = (tuple(r.prompt), repr(r.params), r.adapter_id)
    if key not in cache:
        params = dataclasses.replace(r.params, logprobs=max(r.params.logprobs or 0, 2))
        reference.add_request(f"alone-{len(cache)}", r.prompt, params, r.adapter_id)
        draws: dict[int, list] = {}
        sampler = reference.sampler
        plain = sampler._draw

        def recorded(row, s):
            state = s.generator.get_state() if s.generator is not None else None
            if state is not None:
                draws.setdefault(s.sample_index, []).append((state, sampler.distribution(row, s)))
            return plain(row, s)

        sampler._draw = recorded
        final = None
        try:
            while reference.has_unfinished():
                for out in reference.step():
                    final = out
        finally:
            del sampler._draw
        cache[key] = Alone(final, draws)
    return cache[key]


# logprob units: fp32 logits differ in their last bits between batch compositions on some CPUs (the GEMMs' blocking),
# so two greedy tokens that tie to that precision may go either way
NEAR_TIE = 1e-5


# a seeded draw is a race between the tokens (torch.multinomial draws one sample as the argmax of probs / Exp(1)
# noise from the generator); probabilities that differ in their last bits between batch compositions may flip a race
# that ties to this relative precision
NEAR_TIE_DRAW = 1e-5


def first_difference(got: list[int], want: list[int]) -> int | None:
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return i if i < len(got) else None


def parts_at_a_near_tie(got: list[int], ref) -> bool:
    """`got` equals the reference's tokens up to a step where the reference's best token and `got`'s tie within
    NEAR_TIE (what follows may differ)."""
    i = first_difference(got, ref.token_ids)
    if i is None or i >= len(ref.logprobs):
        return False
    step = ref.logprobs[i]
    top = dict(step.top)
    return got[i] in top and step.logprob - top[got[i]] <= NEAR_TIE


def parts_at_a_near_tie_draw(got: list[int], want: list[int], draws: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """`got` equals the reference's sampled tokens up to a draw that the reference's token and `got`'s won within
    NEAR_TIE_DRAW of each other, replayed from the reference's generator state (what follows may differ). Strict when
    the replay does not give the reference's token (a torch whose multinomial draws otherwise)."""
    i = first_difference(got, want)
    if i is None or i >= len(want) or i >= len(draws):
        return False
    state, probs = draws[i]
    noise = torch.empty_like(probs).exponential_(generator=torch.Generator().set_state(state))
    race = probs / noise
    if int(race.argmax()) != want[i]:
        return False
    return bool(race[want[i]] - race[got[i]] <= NEAR_TIE_DRAW * race[want[i]])


def check_outcomes(engine: LLMEngine, reqs: list[PlannedRequest], outcomes: dict[str, Outcome],
                   reference: LLMEngine, cache: dict) -> int:
    """Assert the invariants; returns how many requests were compared against their run alone."""
    bm = engine.page_manager
    assert bm.num_free_pages == bm.usable_pages, "pages leaked"
    assert not engine.scheduler.running and not engine.scheduler.waiting
    compared = 0
    for r in reqs:
        o = outcomes[r.rid]
        if o.refused:
            assert not o.outputs
            continue
        finished = [i for i, out in enumerate(o.outputs) if out is not None and out.finished]
        assert len(finished) == 1 and finished[0] == len(o.outputs) - 1, f"{r.rid} ended {len(finished)} times"
        final = o.outputs[-1]
        assert sorted(c.index for c in final.outputs) == list(range(len(final.outputs)))
        assert o.aborted or len(final.outputs) == r.params.n
        for c in final.outputs:
            assert c.finish_reason in ("stop", "length", "abort")
            assert len(c.token_ids) <= r.params.max_new_tokens
        if r.params.prompt_logprobs and not o.aborted:
            assert len(final.prompt_logprobs) == len(r.prompt) - 1
        deterministic = r.params.greedy or r.params.seed is not None
        dense = engine.sparse is None or r.params.full_kv
        if deterministic and dense and not o.aborted:
            solo = alone(reference, r, cache)
            ref = solo.output
            assert sorted(c.index for c in final.outputs) == sorted(c.index for c in ref.outputs)
            by_index = {c.index: c for c in ref.outputs}
            for c in final.outputs:
                want = by_index[c.index]
                near = (parts_at_a_near_tie(c.token_ids, want) if r.params.greedy
                        else parts_at_a_near_tie_draw(c.token_ids, want.token_ids, solo.draws.get(c.index, [])))
                assert c.token_ids == want.token_ids or near, f"{r.rid} differs from alone"
            if r.params.prompt_logprobs:
                assert max((abs(a - b) for a, b in zip(final.prompt_logprobs, ref.prompt_logprobs)), default=0) < 1e-4
            compared += 1
        long_samples = [c.token_ids for c in final.outputs if len(c.token_ids) >= 8]
        if not r.params.greedy and r.params.temperature >= 1.0 and len(long_samples) >= 2 and not r.params.stop:
            assert len({tuple(t) for t in long_samples}) > 1, f"{r.rid}: the n samples are identical"
    return compared


def sweep(base: LLMEngine, reference: LLMEngine, seeds: range, mtp: bool = False,
          draft: str | None = None) -> dict[str, int]:
    cache: dict = {}
    totals = {"schedules": 0, "requests": 0, "compared_alone": 0, "preemptions": 0, "aborted": 0, "refused": 0,
              "drafts_accepted": 0}
    vocab = base.model.config.vocab_size
    for seed in seeds:
        rng = random.Random(seed)
        engine = random_engine(rng, base, mtp, draft)
        reqs = random_requests(rng, vocab, len(base.adapter_ids))
        outcomes = run_schedule(engine, reqs)
        totals["compared_alone"] += check_outcomes(engine, reqs, outcomes, reference, cache)
        totals["schedules"] += 1
        totals["requests"] += len(reqs)
        totals["preemptions"] += engine.scheduler.num_preemptions
        totals["aborted"] += sum(o.aborted for o in outcomes.values())
        totals["refused"] += sum(o.refused for o in outcomes.values())
        totals["drafts_accepted"] += engine.speculator.stats.accepted
    return totals
