"""Structured outputs in the engine loop on the tiny random Llama: constrained requests batched with free ones, with
n samples, chunked prefill and a KV pool small enough to preempt (recompute keeps each sample's matcher), always
end in text their grammar accepts; a greedy constrained request gives what it gives alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from mlc.config.engine_config import EngineConfig
from mlc.engine.grammar import GrammarSpec
from mlc.engine.llm import LLM
from mlc.engine.llm_engine import LLMEngine
from mlc.engine.sampling_params import SamplingParams
from tests.support.tiny_llama import build_tiny_llama

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"enum": ["a", "b"]}, "ok": {"type": "boolean"}},
          "required": ["id", "tag", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = build_tiny_llama(tmp_path_factory.mktemp("tiny") / "m")
    return LLMEngine(EngineConfig(model=str(path)), kv_cache_memory="48KiB", page_size=4,  # a few dozen pages
                     max_batch_size=6, max_num_batched_tokens=16)


def test_constrained_and_free_requests_share_batches_under_preemption(engine):
    schema = GrammarSpec.json_schema(SCHEMA)
    regex = GrammarSpec("regex", r"[a-c]{2,6}!")
    llm = LLM(engine=engine)
    prompts = [[5 + i, 40, 77, 3 + i] * 3 for i in range(8)]
    params = []
    for i in range(8):
        grammar = (schema, regex, None)[i % 3]
        params.append(SamplingParams(max_new_tokens=60, temperature=0.0 if i < 4 else 1.0, seed=i,
                                     n=2 if i % 4 == 3 else 1, grammar=grammar))
    outs = llm.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0  # the pool is small enough that some sequence was recomputed
    for out, p in zip(outs, params):
        for o in out.outputs:
            if p.grammar is schema:
                jsonschema.validate(json.loads(o.text), SCHEMA)
            elif p.grammar is regex:
                assert re.fullmatch(r"[a-c]{2,6}!", o.text), o.text
            assert o.finish_reason in ("stop", "length")
    alone = llm.generate([prompts[0]], [params[0]])[0].outputs[0].text
    assert alone == outs[0].outputs[0].text
