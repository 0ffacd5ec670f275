"""The path a user gets with no flags: the default model's Q4_1 GGUF runs as int4 from its own codes (8-bit head)
and a request's greedy output and its logprobs do not depend on what else is in its batch."""

from __future__ import annotations

import pytest

from mlc.engine.llm import LLM
from mlc.engine.sampling_params import SamplingParams
from mlc.layers.cpu_kernels import cpu_op
from mlc.layers.quant_linear import Int4Linear


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), kv_cache_memory="128MiB")


def test_the_gguf_bit_width_is_kept_and_said(llm):
    engine = llm.engine
    assert engine.weights.startswith("int4 from the GGUF's own Q4_1 codes (120 layers)")  # 30 x qkv, o, gate_up, down
    assert "head int8 (default: the GGUF stores its matrices as Q4_1" in engine.weights
    built = cpu_op("int4_linear") is not None  # the C++ kernels where they build, else torch's and fbgemm's
    int4, head = ("mlc-int4", "mlc-int8") if built else ("int4pack-w4a16", "fbgemm-w8a8")
    body = {m.kernel for m in engine.model.model.modules() if isinstance(m, Int4Linear)}
    assert engine.model.lm_head.kernel == head and set(engine.model.quant_report.kernels) == {head} and body == {int4}
    assert engine.max_batch_size == min(256, (engine.cache_plan.num_pages - 1) // (512 // 16))


def test_a_request_alone_equals_it_among_others(llm):
    """Bit for bit, logprobs included: decode attention computes each sequence alone whatever its neighbours'
    lengths, the int4 and int8 kernels quantize and sum each row alone."""
    greedy = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    prompts = ["The sea is", "Tell me about cats.", "1 2 3 4", "Write a poem about the moon and the stars.", "Hi"]

    def seen(out):
        return [(lp.token_id, lp.logprob) for lp in out.outputs[0].logprobs]

    alone = [seen(llm.generate(p, greedy)[0]) for p in prompts]
    together = [seen(o) for o in llm.generate(prompts * 3, greedy)]
    assert together == alone * 3
