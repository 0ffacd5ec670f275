"""Speculative decoding (prompt lookup) changes no token: greedy decoding with drafts verified in the batch is
transformers' greedy in fp32 and the plain engine's, bit for bit, on the default path's arithmetic (bf16, int8), for
every architecture, alone and in a batch; and drafts were proposed and accepted along the way.

The tiny random checkpoints of `test_decode_parity` loop after a few tokens, so prompt lookup finds matches in their
own output; each prompt also repeats itself, so drafts come from the prompt from the first step."""

from __future__ import annotations

import pytest
import torch

from mlc.engine.llm import LLM
from tests.numerics.test_decode_parity import ARCHS, PAGE_SIZE, build_checkpoint, greedy, hf_greedy, prompts

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def spec_prompts(vocab: int) -> list[list[int]]:
    return [p + p[: len(p) // 2] for p in prompts(vocab)]


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory):
    path = build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    hf = ARCHS[request.param][0].from_pretrained(path, dtype=torch.float32).eval()
    batch = spec_prompts(hf.config.vocab_size)
    return path, batch, [hf_greedy(hf, p) for p in batch]


def test_fp32_speculative_decode_is_transformers_greedy(checkpoint):
    path, batch, want = checkpoint
    llm = LLM(str(path), dtype="fp32", page_size=PAGE_SIZE, speculative_config=SPEC)
    assert greedy(llm, batch) == want
    assert [greedy(llm, [p])[0] for p in batch] == want
    stats = llm.engine.speculator.stats
    assert stats.proposals > 0 and stats.accepted > 0, stats
    pm = llm.engine.page_manager
    assert pm.num_free_pages == pm.usable_pages  # rejected drafts' pages all came back


@pytest.mark.parametrize("options", [dict(dtype="bf16"), dict(weight_dtype="int8")], ids=["bf16", "int8"])
def test_default_path_speculative_decode_is_the_plain_engines(checkpoint, options):
    path, batch, _ = checkpoint
    plain = LLM(str(path), page_size=PAGE_SIZE, **options)
    want = greedy(plain, batch, logprobs=2)
    spec = LLM(engine=type(plain.engine)(plain.engine.config, model=plain.engine.model,
                                         tokenizer=plain.engine.tokenizer, speculative_config=SPEC))
    assert greedy(spec, batch, logprobs=2) == want
    assert spec.engine.speculator.stats.proposals > 0  # what was accepted depends on the model's loops
