"""Regression tests for what users report of run-time adapters elsewhere (issue 31): loading while streams run
(they go on, unchanged), and load/unload churn between requests with more adapters than batch slots, base and
adapters mixed: no errors, and every greedy reply equal to an engine that had only that adapter from the start."""

from __future__ import annotations

import asyncio
import random

import pytest

from mlc.bench.lora_synth import write_random_adapter
from mlc.config.engine_config import EngineConfig
from mlc.engine.async_engine import AsyncEngine
from mlc.engine.llm_engine import LLMEngine
from mlc.engine.sampling_params import SamplingParams
from mlc.errors import CapacityError
from tests.support.tiny_llama import build_tiny_llama

LONG = 150
PROMPTS = [[5, 9, 33, 70, 12, 8], [100, 3, 44], [7, 7, 8, 200, 31, 2, 90, 17, 5], list(range(40, 75))]


def params(n: int = 12) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_churn")
    base = build_tiny_llama(root / "base")
    adapters = {f"ad{i}": write_random_adapter(root / f"ad{i}", base, rank=(4, 8)[i % 2], seed=i, std=0.3,
                                               targets=(("q_proj", "v_proj"), ("o_proj", "gate_proj", "down_proj"),
                                                        ("q_proj", "k_proj", "v_proj", "up_proj"))[i % 3])
                for i in range(5)}
    return base, adapters


def reference(base, path, prompt_i: int) -> list[int]:
    """Greedy tokens of an engine that had only this adapter (or none) from the start."""
    eng = LLMEngine(EngineConfig(model=str(base), kv_cache_memory="8MiB",
                                 lora_adapters={"x": str(path)} if path else {}))
    eng.add_request("r", PROMPTS[prompt_i], params(), adapter_id=1 if path else 0)
    while True:
        for out in eng.step():
            if out.finished:
                return out.outputs[0].token_ids


async def collect(gen) -> tuple[list[int], int]:
    outs = [out async for out in gen]
    return outs[-1].outputs[0].token_ids, len(outs)


def test_loading_while_streams_run_keeps_them_going_unchanged(tree):
    base, adapters = tree

    async def main():
        engine = AsyncEngine(LLMEngine(EngineConfig(model=str(base), kv_cache_memory="8MiB")))
        engine.start(asyncio.get_running_loop())
        try:
            streams = [asyncio.create_task(collect(engine.generate(p, params(LONG)))) for p in PROMPTS]
            while not engine.stats().generation_tokens:
                await asyncio.sleep(0.005)
            ids = [await engine.load_lora(name, str(path)) for name, path in adapters.items()]
            assert not any(s.done() for s in streams)  # the loads came mid-stream
            tuned = await collect(engine.generate(PROMPTS[0], params(), adapter_id=ids[1]))
            return [await s for s in streams], tuned
        finally:
            engine.stop()

    streams, tuned = asyncio.run(main())
    alone = LLMEngine(EngineConfig(model=str(base), kv_cache_memory="8MiB"))
    for i, (tokens, deltas) in enumerate(streams):
        alone.add_request(f"{i}", PROMPTS[i], params(LONG))
        assert deltas > 1 and len(tokens) == LONG
    done = {}
    while alone.has_unfinished():
        done |= {o.request_id: o.outputs[0].token_ids for o in alone.step() if o.finished}
    assert [t for t, _ in streams] == [done[f"{i}"] for i in range(len(PROMPTS))]
    assert tuned[0] == reference(base, adapters["ad1"], 0)


def test_churn_with_more_adapters_than_slots_gives_each_adapters_own_replies(tree):
    base, adapters = tree
    names = list(adapters)
    rng = random.Random(0)

    async def main():
        engine = AsyncEngine(LLMEngine(EngineConfig(model=str(base), kv_cache_memory="8MiB", max_loras=2,
                                                    max_cpu_loras=3)))
        engine.start(asyncio.get_running_loop())
        results: list[tuple[str | None, int, list[int]]] = []
        try:
            for _round in range(6):
                jobs = []
                for _ in range(6):  # a few requests, then churn
                    name = rng.choice([None, *names])
                    prompt_i = rng.randrange(len(PROMPTS))
                    if name is not None and name not in engine.adapter_names:
                        try:
                            await engine.load_lora(name, str(adapters[name]))
                        except CapacityError:  # every loaded adapter busy: wait for this round's requests
                            for _, _, task in jobs:
                                await task
                            await engine.load_lora(name, str(adapters[name]))
                    aid = engine.adapter_id(name) if name else 0
                    jobs.append((name, prompt_i, asyncio.create_task(
                        collect(engine.generate(PROMPTS[prompt_i], params(), adapter_id=aid)))))
                for name, prompt_i, task in jobs:
                    results.append((name, prompt_i, (await task)[0]))
                victim = rng.choice(engine.adapter_names) if engine.adapter_names else None
                if victim is not None:
                    await engine.unload_lora(victim)
        finally:
            engine.stop()
        return results

    results = asyncio.run(main())
    cache: dict[tuple[str | None, int], list[int]] = {}
    for name, prompt_i, tokens in results:
        key = (name, prompt_i)
        if key not in cache:
            cache[key] = reference(base, adapters[name] if name else None, prompt_i)
        assert tokens == cache[key], key
    assert len({n for n, _, _ in results}) >= 4
