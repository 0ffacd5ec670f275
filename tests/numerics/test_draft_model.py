"""Speculative decoding with a draft model (`{"method": "draft_model", "model": ...}`, engine/draft_model.py).

Greedy decoding with a draft model's proposals is transformers' greedy (fp32) and the plain engine's (bf16, int8),
for every architecture, alone and in a batch, whatever the draft model: the target itself (its drafts are nearly
all accepted, which proves the draft model reads its own cache right) or a different random model of the same
vocabulary (nearly all rejected)."""

from __future__ import annotations

import pytest
import torch

from mlc.engine.llm import LLM
from mlc.errors import ConfigError
from tests.numerics.test_decode_parity import ARCHS, PAGE_SIZE, build_checkpoint, greedy, hf_greedy, prompts


def _spec(draft) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A random Llama with the same (GLM-style) tokenizer as every target below."""
    return build_checkpoint("llama", tmp_path_factory.mktemp("draft-llama"))


@pytest.fixture(scope="module", params=list(ARCHS))
def target(request, tmp_path_factory):
    path = build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    hf = ARCHS[request.param][0].from_pretrained(path, dtype=torch.float32).eval()
    batch = prompts(hf.config.vocab_size)
    return request.param, path, batch, [hf_greedy(hf, p) for p in batch]


def test_fp32_greedy_with_the_target_as_its_own_draft_is_transformers_greedy(target):
    arch, path, batch, want = target
    llm = LLM(str(path), dtype="fp32", page_size=PAGE_SIZE, speculative_config=_spec(path))
    assert greedy(llm, batch) == want
    assert [greedy(llm, [p])[0] for p in batch] == want
    stats = llm.engine.speculator.stats
    # the same model drafts what it then samples (MoE routing and DSA selection may tie-break apart in a batch)
    assert stats.drafted > 40 and stats.acceptance_rate > (0.6 if "moe" in arch else 0.9), stats
    pm = llm.engine.page_manager
    assert pm.num_free_pages == pm.usable_pages


def test_fp32_greedy_with_another_draft_model_is_transformers_greedy(target, other_draft):
    arch, path, batch, want = target
    # the longest prompt in two chunks, beside the others' decoding (GLM-5's indexer chooses a chunked prompt's keys
    # otherwise than transformers' whole prompt, drafting or not: one piece there)
    budget = 4096 if arch == "glm_moe_dsa" else 16
    llm = LLM(str(path), dtype="fp32", page_size=PAGE_SIZE, speculative_config=_spec(other_draft),
              max_num_batched_tokens=budget)
    assert greedy(llm, batch) == want
    assert llm.engine.speculator.stats.drafted > 0


@pytest.mark.parametrize("options", [dict(dtype="bf16"), dict(weight_dtype="int8")], ids=["bf16", "int8"])
def test_default_path_draft_model_decode_is_the_plain_engines(target, options):
    _, path, batch, _ = target
    want = greedy(LLM(str(path), page_size=PAGE_SIZE, **options), batch, logprobs=2)
    spec = LLM(str(path), page_size=PAGE_SIZE, speculative_config=_spec(path), **options)
    assert greedy(spec, batch, logprobs=2) == want
    assert spec.engine.speculator.stats.accepted > 0


def test_a_draft_model_of_another_vocabulary_is_refused(tmp_path_factory, other_draft):
    from tests.support.tiny_llama import build_tiny_llama

    foreign = build_tiny_llama(tmp_path_factory.mktemp("foreign-vocab"))
    with pytest.raises(ConfigError, match="vocabulary"):
        LLM(str(other_draft), dtype="fp32", speculative_config=_spec(foreign))
    with pytest.raises(ValueError, match="needs \"model\""):
        LLM(str(other_draft), speculative_config={"method": "draft_model"})
