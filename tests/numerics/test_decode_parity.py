"""Greedy decoding through the whole engine (`LLM.generate`: scheduler, paged cache, C++ decode kernel, sampler)
against transformers' `generate`, token by token, for every architecture.

The other numerics tests compare one step's logits through a hand-driven paged cache; a change that only moves
which of two tied keys DSA selects, or that only shows after many steps, slips past them. Here each prompt decodes
DECODE_STEPS tokens, alone and in a batch of different lengths, and the contexts cross DSA's `index_topk`, the
decode key quantum (32) and a page boundary (16). glm_moe_dsa keeps its random indexer (2 heads, so ReLU leaves
many exactly tied index scores): its top-k must break ties as transformers does.

The checkpoints are bf16, as GLM's ship. fp32 is exact: every token is transformers' greedy token (fp32, from the
same weights). The default path's arithmetic (bf16 compute, as a GGUF or bf16 checkpoint runs on a CPU with native
bf16; int8 weights as the default head) is held to a stated tolerance: the logprobs it reports at each step, within
LOGPROB_TOL of transformers' fp32 ones on the same context.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    DynamicCache,
    Glm4ForCausalLM,
    Glm4MoeForCausalLM,
    GlmForCausalLM,
    GlmMoeDsaForCausalLM,
    LlamaForCausalLM,
)

from mlc.engine.llm import LLM
from mlc.engine.sampling_params import SamplingParams
from mlc.layers.attention import KEY_QUANTUM
from tests.numerics import test_glm, test_glm4, test_glm4_moe, test_glm_moe_dsa, test_llama
from tests.support.hf_reference import reference_model
from tests.support.tiny_glm import build_glm_tokenizer

DECODE_STEPS = 40
WEIGHT_STD = 0.1
PAGE_SIZE = 16
INDEX_TOPK = 6
# prompt lengths: below index_topk, one below the key quantum, and one that decodes across 48 and 64 too
PROMPT_LENGTHS = (4, 18, KEY_QUANTUM - 1)
# logprob units, for a vocabulary of ~400 whose logprobs spread over about 5 (std 0.8): bf16 and int8 weights moved
# the dense models' by at most 0.05 here. MoE routing and DSA selection are hard choices that bf16 rounding can
# flip at a near-tie (that step then differs by up to ~3); for them the median step is held to it.
LOGPROB_TOL = 0.1

ARCHS = {
    "llama": (LlamaForCausalLM, test_llama.tiny_config),
    "glm": (GlmForCausalLM, test_glm.tiny_config),
    "glm4": (Glm4ForCausalLM, test_glm4.tiny_config),
    "glm4_moe": (Glm4MoeForCausalLM, test_glm4_moe.tiny_config),
    "glm_moe_dsa": (GlmMoeDsaForCausalLM, lambda **kw: test_glm_moe_dsa.tiny_config(index_topk=INDEX_TOPK, **kw)),
}


def build_checkpoint(arch: str, out: Path) -> Path:
    """A tiny random bf16 checkpoint of `arch` with a GLM-style tokenizer (the engine needs one)."""
    tok = build_glm_tokenizer(out, tags=False)
    model_cls, config = ARCHS[arch]
    cfg = config(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                 max_position_embeddings=256)
    hf = reference_model(model_cls, cfg, seed=3, std=WEIGHT_STD)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p += 1.0  # norms near one, as in trained models, so logits spread over a few units
    hf.to(torch.bfloat16).save_pretrained(out)  # as GLM checkpoints ship
    return out


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(7, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=DECODE_STEPS, min_new_tokens=DECODE_STEPS,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def hf_logprobs(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """`[len(tokens), vocab]`: transformers' fp32 log-probabilities before each token, step by step through its cache
    as `generate` runs (a full forward may select other tied DSA keys)."""
    cache = DynamicCache(config=hf.config)
    steps = [hf(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1]]
    for token in tokens[:-1]:
        steps.append(hf(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1])
    return torch.log_softmax(torch.stack(steps).float(), dim=-1)


def greedy(llm: LLM, batch: list[list[int]], **extra) -> list[list[int]]:
    params = SamplingParams(max_tokens=DECODE_STEPS, temperature=0.0, ignore_eos=True, **extra)
    return [list(o.outputs[0].token_ids) for o in llm.generate(batch, params)]


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory):
    path = build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    hf = ARCHS[request.param][0].from_pretrained(path, dtype=torch.float32).eval()
    batch = prompts(hf.config.vocab_size)
    return path, hf, batch, [hf_greedy(hf, p) for p in batch]


def test_fp32_decode_is_transformers_greedy_alone_and_in_a_batch(checkpoint):
    path, _, batch, want = checkpoint
    llm = LLM(str(path), dtype="fp32", page_size=PAGE_SIZE)
    assert greedy(llm, batch) == want
    assert [greedy(llm, [p])[0] for p in batch] == want


@pytest.mark.parametrize("options", [dict(dtype="bf16"), dict(weight_dtype="int8")], ids=["bf16", "int8"])
def test_default_path_logprobs_stay_within_tolerance(checkpoint, options):
    path, hf, batch, _ = checkpoint
    llm = LLM(str(path), **options)
    params = SamplingParams(max_tokens=DECODE_STEPS, temperature=0.0, ignore_eos=True, logprobs=5)
    errors = []  # per decode step: the largest |ours - transformers| over the chosen token and our top 5
    for prompt, out in zip(batch, llm.generate(batch, params)):
        ref = hf_logprobs(hf, prompt, list(out.outputs[0].token_ids))
        errors += [max(abs(v - float(ref[step, t])) for t, v in [(lp.token_id, lp.logprob), *lp.top])
                   for step, lp in enumerate(out.outputs[0].logprobs)]
    errors.sort()
    assert errors[len(errors) // 2] < LOGPROB_TOL, errors
    if not hf.config.model_type.endswith(("moe", "moe_dsa")):
        assert errors[-1] < LOGPROB_TOL, errors


@pytest.mark.parametrize("arch", [pytest.param(a, marks=() if a == "glm_moe_dsa" else pytest.mark.slow) for a in ARCHS])
def test_fp32_decode_under_tensor_parallel_is_transformers_greedy(arch, tmp_path):
    """Two gloo ranks (heads, experts and the indexer split or replicated as each architecture allows)."""
    path = build_checkpoint(arch, tmp_path)
    hf = ARCHS[arch][0].from_pretrained(path, dtype=torch.float32).eval()
    batch = prompts(hf.config.vocab_size)
    llm = LLM(str(path), dtype="fp32", page_size=PAGE_SIZE, tensor_parallel_size=2, kv_cache_memory="4MiB")
    try:
        assert greedy(llm, batch) == [hf_greedy(hf, p) for p in batch]
    finally:
        llm.engine.shutdown()
