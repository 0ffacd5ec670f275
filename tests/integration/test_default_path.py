"""The path a user gets with no flags: the default model's Q4_1 GGUF runs from its own blocks (its Q4_1 body and
its Q8_0 embedding, which is the tied head), and a request's greedy output and its logprobs do not depend on what
else is in its batch."""

from __future__ import annotations

import pytest

from mlc.engine.llm import LLM
from mlc.engine.sampling_params import SamplingParams
from mlc.layers.cpu_kernels import cpu_op
from mlc.layers.gguf_linear import GGUFEmbedding
from mlc.layers.quant_linear import Int4Linear, QuantizedLinear


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), kv_cache_memory="128MiB")


def test_the_gguf_bit_width_is_kept_and_said(llm):
    engine = llm.engine
    model = engine.model
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    if cpu_op("gguf_linear") is not None:  # the C++ kernels: every matrix from its own blocks, the head too
        # 30 x (qkv, o, gate_up, down), and the tied head from the Q8_0 embedding
        assert engine.weights.startswith("the GGUF's own Q4_1 / Q8_0 blocks (gguf kernel, 121 layers)")
        assert {m.kernel for m in layers if m is not model.lm_head} == {"gguf-Q4_1"}
        assert model.lm_head.kernel == "gguf-Q8_0" and isinstance(model.model.embed_tokens, GGUFEmbedding)
    else:  # torch's kernels: the Q4_1 body from its codes, the 8-bit head quantized from the dequantized embedding
        assert engine.weights.startswith("the GGUF's own Q4_1 blocks (as int4 codes, torch's int4 kernel, 120 layers)")
        assert "the head keeps 8 bits as the GGUF does" in engine.weights
        body = {m.kernel for m in model.model.modules() if isinstance(m, Int4Linear)}
        assert body == {"int4pack-w4a16"} and model.lm_head.kernel == "fbgemm-w8a8"
    assert engine.max_batch_size == min(256, (engine.cache_plan.num_pages - 1) // (512 // 16))


def test_a_request_alone_equals_it_among_others(llm):
    """Bit for bit, logprobs included: decode attention computes each sequence alone whatever its neighbours'
    lengths, the gguf (or int4 and int8) kernels quantize and sum each row alone."""
    greedy = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    prompts = ["The sea is", "Tell me about cats.", "1 2 3 4", "Write a poem about the moon and the stars.", "Hi"]

    def seen(out):
        return [(lp.token_id, lp.logprob) for lp in out.outputs[0].logprobs]

    alone = [seen(llm.generate(p, greedy)[0]) for p in prompts]
    together = [seen(o) for o in llm.generate(prompts * 3, greedy)]
    assert together == alone * 3
