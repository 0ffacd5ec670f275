"""Perplexity as llama.cpp's `llama-perplexity` computes it, from our engine and from llama-perplexity itself on the
same GGUF and text: the text's tokens cut into chunks of `ctx` tokens (the first replaced by BOS where the model
adds one), each chunk scored alone, only its second half counted (each of those tokens sees at least ctx / 2 of
context). So the two figures differ only by the engines' arithmetic (and tokenizers, which are compared too).
"""

from __future__ import annotations

import math
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mlc.engine.llm import LLM
from mlc.engine.sampling_params import SamplingParams
from mlc.errors import ConfigError


@dataclass
class Perplexity:
    value: float
    chunks: int
    tokens_scored: int


def chunks_of(ids: list[int], ctx: int, limit: int | None, bos: int | None) -> list[list[int]]:
    n = len(ids) // ctx
    if n == 0:
        raise ConfigError(f"the text has {len(ids)} tokens, fewer than one chunk of {ctx}; use a longer text or a "
                          "smaller --ctx")
    out = []
    for i in range(min(n, limit) if limit else n):
        chunk = list(ids[i * ctx : (i + 1) * ctx])
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


def ours(llm: LLM, text: str, ctx: int = 512, limit: int | None = None) -> Perplexity:
    """Our engine on its chunks: prompt logprobs of each chunk (one request each, all in one batch)."""
    tok = llm.engine.tokenizer
    add_bos = bool(getattr(tok, "add_bos_token", False)) and tok.bos_token_id is not None
    ids = tok.encode(text, add_special_tokens=False)
    chunks = chunks_of(ids, ctx, limit, tok.bos_token_id if add_bos else None)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=True, ignore_eos=True)
    nll, count, first = 0.0, 0, ctx // 2
    for out in llm.generate(chunks, params):
        lps = out.prompt_logprobs or []  # of tokens 1 .. ctx - 1
        scored = lps[first:]  # tokens first + 1 .. ctx - 1, as llama-perplexity counts them
        nll -= sum(scored)
        count += len(scored)
    return Perplexity(math.exp(nll / count), len(chunks), count)


_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+)")


def llama_cpp(binary: Path, gguf: Path, text: str, ctx: int = 512, limit: int | None = None,
              threads: int = 2) -> Perplexity:
    """llama-perplexity on the same text (written to a file for it)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    cmd = [str(binary), "-m", str(gguf), "-f", f.name, "-c", str(ctx), "-b", str(ctx), "-t", str(threads)]
    if limit:
        cmd += ["--chunks", str(limit)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    Path(f.name).unlink(missing_ok=True)
    found = _FINAL.search(run.stdout + run.stderr)
    if run.returncode != 0 or not found:
        tail = " | ".join((run.stderr or run.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"llama-perplexity failed (exit {run.returncode}): {tail}")
    chunks = int(m.group(1)) if (m := re.search(r"calculating perplexity over (\d+) chunks", run.stderr)) else 0
    return Perplexity(float(found.group(1)), chunks, chunks * (ctx - 1 - ctx // 2))
