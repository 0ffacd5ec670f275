"""The default model (SmolLM2-135M-Instruct from the store): our greedy decoding through the paged cache equals
transformers' greedy `generate` from the same safetensors, token for token, for 32 new tokens."""

from __future__ import annotations

import pytest
import torch

from tests.support.paged import PagedRunner
from tests.support.prompts import CHAT_PROMPTS

NEW_TOKENS = 32
PROMPTS = CHAT_PROMPTS


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    from mlc.models.tokenizer import load_tokenizer, render_chat

    tokenizer = load_tokenizer(default_model_dir)
    texts = [render_chat(tokenizer, m) for m in PROMPTS]
    assert all(t.endswith("<|im_start|>assistant\n") for t in texts)
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], tokenizer.eos_token_id


@pytest.fixture(scope="module")
def ours(default_model_dir):
    from mlc.models.loader import load_model

    return load_model(default_model_dir, weight_dtype="fp32")  # parity: the GGUF default is int4


@pytest.fixture(scope="module")
def theirs(default_model_dir):
    from mlc.models.hf_checkpoint import transformers_model

    return transformers_model(default_model_dir).eval()


def paged_greedy(model, prompts: list[list[int]], eos: int, n: int) -> list[list[int]]:
    """All prompts prefilled in one step, then one token per step for every unfinished sequence."""
    runner = PagedRunner(model, max_len=max(map(len, prompts)) + n + 4, num_seqs=len(prompts))
    out: list[list[int]] = [[] for _ in prompts]
    work = dict(enumerate(prompts))
    while work:
        logits = runner.step(work)
        work = {}
        for i, lg in logits.items():
            out[i].append(int(lg[-1].argmax()))
            if out[i][-1] != eos and len(out[i]) < n:
                work[i] = [out[i][-1]]
    return out


def test_greedy_matches_transformers(prompts, ours, theirs):
    ids, eos = prompts
    got = paged_greedy(ours, ids, eos, NEW_TOKENS)
    for i, prompt in enumerate(ids):
        with torch.inference_mode():
            ref = theirs.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        expected = ref[0, len(prompt):].tolist()
        assert got[i] == expected, f"prompt {i}: ours {got[i]} vs transformers {expected}"
    assert sum(len(g) for g in got) >= 3 * NEW_TOKENS  # the prompts ask for long answers


def test_prefill_logits_match_transformers(prompts, ours, theirs):
    ids, _ = prompts
    with torch.inference_mode():
        ref = theirs(torch.tensor([ids[0]])).logits[0]
    got = ours.dense_logits([ids[0]])[0]
    assert (got - ref).abs().max().item() < 1e-4
