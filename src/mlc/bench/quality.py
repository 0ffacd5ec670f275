"""Quality of one engine configuration, measured through the engine itself (so a compressed or quantized KV cache,
or quantized weights, is what gets scored). Shared by `mlc-cli bench kv` and `mlc-cli bench quant`.

* `perplexity`: exp of the mean negative log-likelihood of a text, from prompt logprobs with chunked prefill: each
  chunk of `chunk` tokens reads the KV the engine kept of the chunks before it.
* `greedy_agreement`: greedy continuations against reference ones (from the fp32 baseline): matched prefix tokens
  over reference tokens, summed over prompts (a token after the first divergence never counts, since the contexts
  differ from there on).
* `needle_scores`: a sentence with a random 5-digit code inserted at several depths of a haystack of Genesis (KJV,
  `mlc/data/genesis-kjv.txt`); the model completes "The secret code is"; score = exact retrievals / trials.

Everything is greedy and seeded, so two configurations see exactly the same prompts.
"""

from __future__ import annotations

import contextlib
import math
import random
import re
from dataclasses import dataclass
from importlib import resources

from mlc.engine.llm import LLM
from mlc.engine.sampling_params import SamplingParams
from mlc.errors import ConfigError, InvalidRequestError

LONG_TEXT = "genesis-kjv.txt"
NEEDLE = "The secret code is {code}. Remember the secret code: {code}."
QUESTION = "\n\nQuestion: What is the secret code in the text above?\nAnswer: The secret code is"
DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def long_text() -> str:
    """Genesis 1-10, King James Version (public domain; see mlc/data/README.md)."""
    return resources.files("mlc.data").joinpath(LONG_TEXT).read_text(encoding="utf-8")


def long_text_ids(llm: LLM, max_tokens: int | None = None) -> list[int]:
    ids = llm.engine.encode(long_text())
    return ids[:max_tokens] if max_tokens else ids


@contextlib.contextmanager
def _step_budget(llm: LLM, tokens: int):
    """Run with a per-step token budget of `tokens` (the prefill chunk), restored afterwards."""
    if not llm.engine.config.enable_chunked_prefill:
        raise ConfigError("quality scoring needs an engine with enable_chunked_prefill (chunks read the kept KV)")
    scheduler = llm.engine.scheduler
    saved, scheduler.budget = scheduler.budget, tokens
    try:
        yield
    finally:
        scheduler.budget = saved


@dataclass
class ScoreResult:
    logprobs: list[float]  # of tokens 1..n-1
    decode_tokens_per_s: float | None  # batch-1 decode right after the text, at its full context (median step)


def score_text(llm: LLM, text_ids: list[int], chunk: int = 512, decode_tokens: int = 0) -> ScoreResult:
    """Per-token logprobs of `text_ids` through the paged cache, then optionally `decode_tokens` greedy tokens
    (timed: the decode speed at this context length with this cache)."""
    if len(text_ids) < 2:
        raise InvalidRequestError("perplexity needs a text of at least 2 tokens")
    params = SamplingParams(max_new_tokens=max(1, decode_tokens), temperature=0.0, prompt_logprobs=True,
                            ignore_eos=True)
    with _step_budget(llm, chunk):
        out = llm.generate([text_ids], params)[0]
    lps = out.prompt_logprobs or []
    if len(lps) != len(text_ids) - 1:
        raise RuntimeError(f"the engine scored {len(lps)} of {len(text_ids) - 1} tokens")
    gaps = sorted(b - a for a, b in zip(out.metrics.token_times, out.metrics.token_times[1:]))
    # the median step: one stall from a neighbour on a shared machine moves a mean, not this
    rate = 1.0 / gaps[len(gaps) // 2] if gaps and gaps[len(gaps) // 2] > 0 else None
    return ScoreResult(lps, rate)


def perplexity(llm: LLM, text_ids: list[int], chunk: int = 512) -> float:
    return perplexity_of(score_text(llm, text_ids, chunk).logprobs)


def perplexity_of(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def greedy_tokens(llm: LLM, prompts: list[list[int]], max_new_tokens: int, chunk: int = 512) -> list[list[int]]:
    """Greedy continuations, fixed length (EOS ignored, so every prompt yields `max_new_tokens` tokens)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    with _step_budget(llm, chunk):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def greedy_agreement(
    llm: LLM, prompts: list[list[int]], reference_token_lists: list[list[int]], max_new_tokens: int
) -> float:
    """Matched-prefix tokens / reference tokens over all prompts (1.0: every continuation identical)."""
    if len(prompts) != len(reference_token_lists):
        raise InvalidRequestError("give one reference token list per prompt")
    refs = [list(r[:max_new_tokens]) for r in reference_token_lists]
    outs = greedy_tokens(llm, prompts, max_new_tokens)
    return agreement(outs, refs)


def agreement(outputs: list[list[int]], references: list[list[int]]) -> float:
    matched = total = 0
    for out, ref in zip(outputs, references):
        n = 0
        while n < min(len(out), len(ref)) and out[n] == ref[n]:
            n += 1
        matched += n
        total += len(ref)
    return matched / total if total else 1.0


def agreement_prompts(llm: LLM, n: int = 32, length: int = 1024) -> list[list[int]]:
    """`n` excerpts of `length` tokens of the long text, at evenly spaced offsets (the model continues each)."""
    ids = long_text_ids(llm)
    if length >= len(ids):
        raise InvalidRequestError(f"agreement prompts of {length} tokens need a text longer than {len(ids)} tokens")
    step = (len(ids) - length) / max(1, n - 1)
    return [ids[round(i * step) : round(i * step) + length] for i in range(n)]


@dataclass
class NeedleTrial:
    context: int
    depth: float
    code: str
    prompt_ids: list[int]


def needle_trials(
    llm: LLM, contexts=(2048, 4096, 7168), trials: int = 5, seed: int = 0, depths: tuple[float, ...] | None = None
) -> list[NeedleTrial]:
    """Prompts of exactly `context` tokens: haystack, the needle at a sentence end near each depth, the question."""
    rng = random.Random(seed)
    encode = llm.engine.encode
    hay = long_text_ids(llm)
    question = encode(QUESTION)
    depths = depths or _depths(trials)
    out = []
    for context in contexts:
        for depth in depths:
            code = str(rng.randrange(10_000, 100_000))
            needle = encode(" " + NEEDLE.format(code=code))
            room = context - len(question) - len(needle)
            if room <= 0 or room > len(hay):
                raise InvalidRequestError(
                    f"a needle context of {context} tokens does not fit the {len(hay)}-token text; use a shorter one"
                )
            cut = _sentence_end(llm, hay, int(depth * room))
            out.append(NeedleTrial(context, depth, code, hay[:cut] + needle + hay[cut:room] + question))
    return out


def _depths(trials: int) -> tuple[float, ...]:
    if trials == len(DEFAULT_DEPTHS):
        return DEFAULT_DEPTHS
    return tuple(0.1 + 0.8 * i / max(1, trials - 1) for i in range(trials)) if trials > 1 else (0.5,)


def _sentence_end(llm: LLM, ids: list[int], near: int) -> int:
    """The first index at or after `near` that follows a token ending a sentence (or `near` itself)."""
    tok = llm.tokenizer
    for i in range(max(near, 1), min(near + 64, len(ids))):
        # transformers types decode() as str | list[str]; one list of ids decodes to a str
        if tok.decode(ids[i - 1 : i]).rstrip().endswith((".", ":", ";")):  # type: ignore[union-attr]
            return i
    return near


def needle_hits(llm: LLM, trials: list[NeedleTrial], chunk: int = 512) -> list[bool]:
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    with _step_budget(llm, chunk):
        outs = llm.generate([t.prompt_ids for t in trials], params)
    return [_first_number(o.outputs[0].text) == t.code for o, t in zip(outs, trials)]


def _first_number(text: str) -> str | None:
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def needle_scores(llm: LLM, contexts=(2048, 4096, 7168), trials: int = 5, seed: int = 0) -> dict[int, float]:
    """Exact retrieval rate per context length."""
    cases = needle_trials(llm, contexts, trials, seed)
    hits = needle_hits(llm, cases)
    return {c: sum(h for h, t in zip(hits, cases) if t.context == c) / trials for c in contexts}
