"""`bench compare`: the same workloads on our server and on each peer present, on this machine, interleaved.

Peers: llama.cpp's `llama-server` on the same GGUF file (bench/llama_cpp.py finds or builds it), and, offline,
transformers `generate` (static batches) and transformers' continuous batching (`generate_batch`).
Each server first answers WARM_REQUESTS whole requests, then the machine settles for SETTLE_S. Workloads, each run
on every server before the next starts (the order alternates, so a drift of the machine hurts both sides alike):
  concurrency levels   N chat requests of `max_tokens` (EOS ignored) at each level: tok/s, TTFT/TPOT/ITL/E2E
  request rate         the same requests arriving as a Poisson process: latency percentiles, goodput
  prefill              one long prompt (GPL-3 text), max_tokens 1: prompt tokens/s from the time to first token
  shared prefix        requests sharing a long system prompt, against the same prompts made unique: the gain
                       of prefix caching is TTFT(unique) / TTFT(shared)
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from mlc.bench import peers
from mlc.bench.serve import BenchConfig, LevelReport, load_prompts, run_level, run_one

GPL3 = Path("/usr/share/common-licenses/GPL-3")
WARM_REQUESTS = 3  # full-length requests per server before the first measured level
SETTLE_S = 2.0


@dataclass
class CompareConfig:
    model: str
    out_dir: Path
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    num_prompts: int = 32
    max_tokens: int = 64
    request_rate: float | None = 4.0
    prefill_tokens: int = 4000
    shared_prefix_tokens: int = 1000
    shared_requests: int = 16
    llama_server: Path | None = None
    build_llama: bool = True
    threads: int | None = None  # llama-server -t; default: the usable cores
    ours_args: list[str] = field(default_factory=list)
    offline: bool = True
    offline_prompts: int = 32
    seed: int = 0


def long_text() -> str:
    """Long English text: Debian's GPL-3 (common-licenses), else the packaged Genesis text."""
    if GPL3.is_file():
        return GPL3.read_text(encoding="utf-8")
    from mlc.bench.prompts import long_text as genesis

    return genesis()


def words_for_tokens(text: str, tokens: int, tokenizer) -> str:
    """The longest whole-line prefix of `text` (repeated if short) that stays under `tokens` tokens."""
    while len(tokenizer.encode(text)) < tokens:
        text = text + "\n" + text
    lines, out, count = text.splitlines(), [], 0
    for line in lines:
        n = len(tokenizer.encode(line + "\n"))
        if count + n > tokens:
            break
        out.append(line)
        count += n
    return "\n".join(out)


def _bench_cfg(cfg: CompareConfig, url: str, **kw) -> BenchConfig:
    return BenchConfig(url=url, concurrency=[1], num_prompts=cfg.num_prompts, max_tokens=cfg.max_tokens,
                       ignore_eos=True, seed=cfg.seed, **kw)


def _chat(model: str, messages: list[dict], max_tokens: int) -> dict:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}


async def _level(url: str, bodies: list[dict], concurrency: int, bcfg: BenchConfig) -> LevelReport:
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(bcfg.timeout_s), limits=limits) as client:
        return await run_level(client, url, bodies, concurrency, bcfg)


async def _warm(url: str, body: dict, max_tokens: int = 4) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600)) as client:
        r = await run_one(client, url, {**body, "max_tokens": max_tokens})
    if not r.ok:
        raise RuntimeError(f"the warm-up request to {url} failed: {r.error}")


def _interleave(servers: list, index: int) -> list:
    return servers if index % 2 == 0 else list(reversed(servers))


def model_ids(servers: list[peers.RunningServer]) -> dict[str, str]:
    """Each server's model id, as its /v1/models names it."""
    return {s.spec.label: httpx.get(s.spec.url + "/v1/models", timeout=30).json()["data"][0]["id"] for s in servers}


def warm_up(servers: list[peers.RunningServer], mid: dict[str, str], chats: list, max_tokens: int) -> None:
    """Whole requests, as measured, so first-request costs stay out of the first level; then the machine settles."""
    for s in servers:
        for m in chats[:WARM_REQUESTS]:
            asyncio.run(_warm(s.spec.url, _chat(mid[s.spec.label], m, max_tokens), max_tokens))
    time.sleep(SETTLE_S)  # a server's worker threads may spin for a while after its last request


def run_levels(cfg: CompareConfig, servers: list[peers.RunningServer], mid: dict[str, str], chats: list,
               levels: list[int], progress, step: int = 0) -> dict[str, list[dict]]:
    """The chats at each concurrency level on every server, interleaved: {label: [level report, ...]}."""
    out: dict[str, list[dict]] = {}
    for level in levels:
        for s in _interleave(servers, step):
            bodies = [_chat(mid[s.spec.label], m, cfg.max_tokens) for m in chats]
            rep = asyncio.run(_level(s.spec.url, bodies, level, _bench_cfg(cfg, s.spec.url)))
            out.setdefault(s.spec.label, []).append(rep.as_dict())
            progress(f"{s.spec.label}: concurrency {level}: {rep.output_tok_s:.1f} tok/s, {rep.failed} failed")
        step += 1
    return out


def run_prefill(cfg: CompareConfig, servers: list[peers.RunningServer], mid: dict[str, str], long: str, progress,
                step: int = 0) -> dict[str, dict]:
    """One long prompt (`long`), max_tokens 1, three times per server: prompt tokens/s from the best TTFT."""
    out: dict[str, dict] = {}
    for s in _interleave(servers, step):
        runs = []
        for i in range(3):  # a distinct first line each time: no server can answer from its prompt cache
            doc = f"Document {i + 1} of 3.\n{long}\n\nSummarize it."
            body = _chat(mid[s.spec.label], [{"role": "user", "content": doc}], 1)
            runs.append(asyncio.run(_level(s.spec.url, [body], 1, _bench_cfg(cfg, s.spec.url))).as_dict())
        ttfts = [r["ttft_ms"]["p50"] for r in runs if r["completed"]]
        tokens = runs[0]["prompt_tokens"]
        best = min(ttfts) if ttfts else None
        out[s.spec.label] = {"prompt_tokens": tokens, "ttft_ms_runs": ttfts,
                             "prompt_tok_s": tokens / best * 1000 if best else None}
        progress(f"{s.spec.label}: prefill of {tokens} tokens: best TTFT {best or float('nan'):.0f} ms")
    return out


def chat_prompts_for(cfg: CompareConfig) -> tuple[list, list]:
    """(the builtin prompt set, `num_prompts` chats drawn from it with the run's seed)."""
    rng = random.Random(cfg.seed)
    prompts = load_prompts("builtin")
    return prompts, [prompts[rng.randrange(len(prompts))] for _ in range(cfg.num_prompts)]


def run_servers(cfg: CompareConfig, servers: list[peers.RunningServer], tokenizer, progress) -> dict:
    """Every workload on every server; returns {workload: {label: result dict}}."""
    rng = random.Random(cfg.seed + 1)
    prompts, chats = chat_prompts_for(cfg)
    text = long_text()
    results: dict[str, dict] = {"concurrency": {}, "request_rate": {}, "prefill": {}, "shared_prefix": {}}
    mid = model_ids(servers)
    warm_up(servers, mid, chats, cfg.max_tokens)
    results["concurrency"] = run_levels(cfg, servers, mid, chats, cfg.concurrency, progress)
    step = len(cfg.concurrency)
    if cfg.request_rate:
        for s in _interleave(servers, step):
            bodies = [_chat(mid[s.spec.label], m, cfg.max_tokens) for m in chats]
            bcfg = _bench_cfg(cfg, s.spec.url, request_rate=cfg.request_rate)
            rep = asyncio.run(_level(s.spec.url, bodies, max(cfg.concurrency) * 2, bcfg))
            results["request_rate"][s.spec.label] = rep.as_dict()
            progress(f"{s.spec.label}: {cfg.request_rate} req/s: TTFT p50 {rep.ttft_ms.p50:.0f} ms, "
                     f"p99 {rep.ttft_ms.p99:.0f} ms")
        step += 1
    long = words_for_tokens(text, cfg.prefill_tokens, tokenizer)
    results["prefill"] = run_prefill(cfg, servers, mid, long, progress, step)
    step += 1
    system = words_for_tokens(text, cfg.shared_prefix_tokens, tokenizer)
    questions = [p[0]["content"] for p in prompts][: cfg.shared_requests]
    for s in _interleave(servers, step):
        out: dict[str, Any] = {}
        for kind in ("unique", "shared"):
            bodies = []
            for i, q in enumerate(questions):
                head = f"Case {i} of a {kind} workload {rng.random()}.\n" if kind == "unique" else ""
                bodies.append(_chat(mid[s.spec.label], [{"role": "system", "content": head + system},
                                                {"role": "user", "content": q}], 16))
            if kind == "shared":  # the first request fills the cache, as in a real workload's steady state
                asyncio.run(_warm(s.spec.url, bodies[0]))
            out[kind] = asyncio.run(_level(s.spec.url, bodies, 4, _bench_cfg(cfg, s.spec.url))).as_dict()
        u, sh = out["unique"]["ttft_ms"]["p50"], out["shared"]["ttft_ms"]["p50"]
        out["ttft_gain"] = u / sh if u and sh else None
        results["shared_prefix"][s.spec.label] = out
        progress(f"{s.spec.label}: shared prefix: TTFT p50 {sh or float('nan'):.0f} ms vs unique "
                 f"{u or float('nan'):.0f} ms")
        step += 1
    return results
