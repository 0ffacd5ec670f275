"""`engine.compile` / `--compile`: the forward pass as one torch.compile graph with paged attention as an opaque op.

The slow test compiles for real (inductor, a C++ compiler) and checks the compiled engine against the eager one
and against itself in different batches; the others check the refusals and the fall-back to eager, without
compiling anything."""

from __future__ import annotations

import logging

import pytest
import torch

from mlc.engine.compiled_forward import CompiledForward, check_compilable
from mlc.engine.llm import LLM
from mlc.engine.sampling_params import SamplingParams
from mlc.errors import ConfigError

PROMPTS = ["Hello, thank you", "Where is my refund?", "您好", "How do I reset my password? Where is my order?"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.support.tiny_llama import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("compile") / "llama"))


def seen(outputs):
    return [[(lp.token_id, lp.logprob) for lp in o.outputs[0].logprobs] for o in outputs]


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)


@pytest.mark.slow
def test_compiled_engine_matches_eager_and_does_not_depend_on_the_batch(tiny, caplog):
    eager = seen(LLM(tiny, kv_cache_memory="4MiB").generate(PROMPTS, GREEDY))
    with caplog.at_level(logging.INFO, logger="mlc.engine"):
        llm = LLM(tiny, kv_cache_memory="4MiB", compile=True)
    forward = llm.engine.model.forward
    assert isinstance(forward, CompiledForward) and forward.failed is None and forward.compiled_in > 0
    assert "forward pass compiled in" in caplog.text  # at load, before any request
    together = seen(llm.generate(PROMPTS * 2, GREEDY))
    assert [[t for t, _ in row] for row in together[:4]] == [[t for t, _ in row] for row in eager]
    for got, want in zip(together, eager * 2):  # fp32: fused kernels only reorder a few roundings
        assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) < 1e-4
    # int4 weights in bf16, as the default path computes: the same graph for every batch, so bit for bit alone and
    # in a batch. (Plain bf16 matmuls are not: on AMX CPUs oneDNN picks another kernel for one row than for eight.)
    llm = LLM(tiny, kv_cache_memory="4MiB", compile=True, dtype="bf16", weight_dtype="int4")
    together = seen(llm.generate(PROMPTS * 2, GREEDY))
    alone = [seen(llm.generate(p, GREEDY))[0] for p in PROMPTS]
    assert llm.engine.model.forward.failed is None and together == alone * 2


def test_a_failed_compile_runs_eagerly_with_a_warning(tiny, monkeypatch, caplog):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    want = seen(LLM(tiny, kv_cache_memory="4MiB").generate(PROMPTS, GREEDY))
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: no_compiler)
    with caplog.at_level(logging.WARNING, logger="mlc.engine"):
        llm = LLM(tiny, kv_cache_memory="4MiB", compile=True)  # compiles (and fails) as the model loads
    assert "compiling the forward pass failed (RuntimeError: InvalidCxxCompiler" in caplog.text
    assert "running eagerly" in caplog.text
    assert seen(llm.generate(PROMPTS, GREEDY)) == want


def test_what_compile_does_not_cover_is_refused():
    with pytest.raises(ConfigError, match="not 'glm4_moe'; serve this model without --compile"):
        check_compilable("glm4_moe", 1, {})
    with pytest.raises(ConfigError, match="one rank; drop --compile or --tensor-parallel-size"):
        check_compilable("llama", 2, {})
    with pytest.raises(ConfigError, match="LoRA adapters yet"):
        check_compilable("llama", 1, {"support": "/x"})
    check_compilable("glm4", 1, {})


def test_loading_an_adapter_goes_back_to_eager(tiny, tmp_path, caplog):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    peft.save_pretrained(str(tmp_path / "adapter"))
    llm = LLM(tiny, kv_cache_memory="4MiB", compile=True)
    with caplog.at_level(logging.INFO, logger="mlc.engine"):
        llm.engine.add_lora("support", str(tmp_path / "adapter"))
    assert not isinstance(llm.engine.model.forward, CompiledForward)
    assert "LoRA adapter 'support' loaded; the forward pass runs eagerly" in caplog.text
