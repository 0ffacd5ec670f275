"""`mlc-cli bench pd`: prefill/decode disaggregation.

`transfer`: the KV pages of one long context (8K tokens by default) of a model, moved as a decode instance pulls them:
packed out of the cache, sent over a gloo pair group to a receiver in another process, unpacked into pages; bytes,
milliseconds per phase and the effective rate, against a plain in-memory copy of the same bytes measured in the same
run (the loopback ceiling).

`ab`: 2 colocated replicas (`--kv-role both`, chunked prefill, a client-side least-loaded split) against 1 prefill +
1 decode instance behind the PD router, each on its share of the cores: steady short chats, alone and beside
Poisson-arriving long prompts at each rate asked for; the short chats' decode TPOT p99 (and TTFT, throughput) per
layout, and a plot of that p99 against the share of requests that are long.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import random
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from mlc.bench.peers import RunningServer, ServerSpec, free_port
from mlc.bench.serve import RequestResult, arrival_gaps, run_one
from mlc.bench.stats import percentile
from mlc.config.engine_config import EngineConfig


@dataclass
class TransferReport:
    model: str
    context_tokens: int
    pages: int
    bytes: int
    prefilled: bool
    pack_ms: float
    gloo_ms: float  # steady state (the first transfer, which also builds the pair group, is `first_gloo_ms`)
    first_gloo_ms: float
    unpack_ms: float
    memcpy_ms: float

    @property
    def total_ms(self) -> float:
        return self.pack_ms + self.gloo_ms + self.unpack_ms

    def rate(self, ms: float) -> float:
        """GB/s for this many milliseconds."""
        return self.bytes / (ms / 1e3) / 1e9 if ms > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "total_ms": self.total_ms, "effective_gb_s": self.rate(self.total_ms),
                "gloo_gb_s": self.rate(self.gloo_ms), "memcpy_gb_s": self.rate(self.memcpy_ms)}


def _receiver(address: str, num_bytes: int, reps: int, out: Any) -> None:
    from mlc.engine.kv_transport import KVReceiver

    rx = KVReceiver(timeout=60)
    out.put(rx.pair_id(address))
    for tag in range(1, reps + 1):
        rx.recv(address, tag, num_bytes)
        out.put(time.monotonic())  # CLOCK_MONOTONIC is one clock for every process on the machine


def _ms(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_transfer(cfg: EngineConfig, context: int = 8192, reps: int = 5, prefill: bool = True) -> TransferReport:
    import torch

    from mlc.engine.kv_cache import KVCache, kv_dtype
    from mlc.engine.kv_transfer import pack, pack_bytes, unpack
    from mlc.engine.kv_transport import KVSender
    from mlc.engine.llm_engine import LLMEngine
    from mlc.engine.sampling_params import SamplingParams
    from mlc.engine.sequence import Sequence
    from mlc.models.loader import load_model

    model = load_model(cfg.model, cfg.device, cfg.dtype, cfg.weight_dtype)
    limit = int(getattr(model.config, "max_position_embeddings", 0) or context + 1)
    context = min(context, limit - 1)
    per_token = KVCache.bytes_per_token_for(model.kv_cache_spec(), kv_dtype(cfg.kv_cache_dtype, model.dtype))
    need = int(per_token * (2 * context + 64 * cfg.page_size) * 1.1)
    engine = LLMEngine(EngineConfig(**{**cfg.model_dump(), "kv_cache_memory": max(cfg.kv_cache_memory or 0, need),
                                       "max_seq_len": context + 1}), model=model)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size - 100, (context,), generator=gen).tolist()
    if prefill:
        engine.prefill_for_transfer("bench", ids, SamplingParams(max_tokens=1, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
        handle = engine.kv_handle("bench")
        assert handle is not None
        pages = handle.page_ids
    else:  # pages as a prefill would leave them, their contents whatever the cache held
        seq = Sequence("bench", ids, SamplingParams())
        engine.page_manager.grow(seq, context)
        pages = seq.page_table
    cache = engine.kv_cache
    dst = Sequence("dst", ids, SamplingParams())
    engine.page_manager.grow(dst, context)
    num_bytes = pack_bytes(cache, len(pages))
    pack_ms = _ms(lambda: pack(cache, pages), reps)
    buf = pack(cache, pages)
    unpack_ms = _ms(lambda: unpack(cache, dst.page_table, buf), reps)
    copy_to = torch.empty_like(buf)
    memcpy_ms = _ms(lambda: copy_to.copy_(buf), reps)
    sender = KVSender(timeout=60)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(sender.address, num_bytes, reps + 1, out), daemon=True)
    proc.start()
    try:
        pair = out.get(timeout=60)
        gloo = []
        for tag in range(1, reps + 2):
            t0 = time.monotonic()
            sender.send(pair, tag, buf).result(timeout=120)
            gloo.append((out.get(timeout=120) - t0) * 1e3)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        sender.close()
    return TransferReport(cfg.model, context, len(pages), num_bytes, prefill, pack_ms, statistics.median(gloo[1:]),
                          gloo[0], unpack_ms, memcpy_ms)


# A/B ----------------------------------------------------------------------------------------------------------------
@dataclass
class LoadReport:
    layout: str
    long_rate: float
    chats: int
    longs: int
    errors: int
    chat_tpot_p50_ms: float
    chat_tpot_p99_ms: float
    chat_ttft_p50_ms: float
    chat_ttft_p99_ms: float
    long_ttft_p50_ms: float
    output_tok_s: float
    first_error: str | None = None  # what the first failed request answered (a run with errors says why)


@dataclass
class ABConfig:
    model: str
    duration_s: float = 60.0
    chat_rate: float = 1.0  # short chats per second (Poisson)
    long_rates: list[float] = field(default_factory=lambda: [0.1])  # long prompts per second (Poisson), one run each
    long_tokens: int = 4096
    chat_max_tokens: int = 64
    threshold_tokens: int = 512
    cores: list[int] = field(default_factory=lambda: list(range(os.cpu_count() or 2)))
    extra_args: list[str] = field(default_factory=list)


def _long_prompt(tokens: int, rng: random.Random) -> str:
    """About `tokens` tokens (a word and a number are 3.5-4 tokens with common tokenizers; 5,321 for 4,096 asked when
    this made a word per 3)."""
    words = ["alpha", "river", "stone", "cloud", "seven", "orange", "quiet", "north", "paper", "glass"]
    return " ".join(f"{rng.choice(words)}{rng.randrange(1000)}" for _ in range(tokens // 4)) + "\nSummarize."


def _server(cfg: ABConfig, role: str, cores: list[int], log_dir: Path) -> ServerSpec:
    port = free_port()
    pin = ["taskset", "-c", ",".join(map(str, cores))] if shutil.which("taskset") and cores else []
    argv = [*pin, sys.executable, "-m", "mlc.cli.main", "serve", "--model", cfg.model, "--host", "127.0.0.1",
            "--port", str(port), "--no-access-log", "--log-level", "warning", "--kv-role", role,
            "--threads", str(max(1, len(cores))), "--max-seq-len", str(cfg.long_tokens + 1024), *cfg.extra_args]
    return ServerSpec(f"mlc serve --kv-role {role} on cores {cores}", argv, port, log_dir / f"pd-{role}-{port}.log")


async def _load(cfg: ABConfig, send: Any, long_rate: float, seed: int) -> tuple[list[RequestResult],
                                                                                  list[RequestResult], float]:
    rng = random.Random(seed)
    n_chat = max(1, int(cfg.duration_s * cfg.chat_rate))
    n_long = int(cfg.duration_s * long_rate)
    chats: list[asyncio.Task] = []
    longs: list[asyncio.Task] = []

    async def feed(n: int, rate: float, make: Any, into: list[asyncio.Task], s: int) -> None:
        for gap in arrival_gaps(n, rate, s):
            await asyncio.sleep(gap)
            into.append(asyncio.ensure_future(send(make())))

    def chat() -> dict:
        q = f"In one paragraph, what is {rng.choice(['rain', 'a river', 'a star', 'bread'])}? ({rng.random():.4f})"
        return {"messages": [{"role": "user", "content": q}], "max_tokens": cfg.chat_max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}

    def long() -> dict:
        return {"messages": [{"role": "user", "content": _long_prompt(cfg.long_tokens, rng)}], "max_tokens": 16,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}

    t0 = time.perf_counter()
    feeders = [feed(n_chat, cfg.chat_rate, chat, chats, seed)]
    if n_long:
        feeders.append(feed(n_long, long_rate, long, longs, seed + 1))
    await asyncio.gather(*feeders)
    done_chats = await asyncio.gather(*chats)
    done_longs = await asyncio.gather(*longs)
    return list(done_chats), list(done_longs), time.perf_counter() - t0


def _report(layout: str, long_rate: float, chats: list[RequestResult], longs: list[RequestResult],
            wall: float) -> LoadReport:
    ok = [r for r in chats if r.ok]
    tpots = [r.tpot * 1e3 for r in ok if r.tpot is not None]
    ttfts = [r.ttft * 1e3 for r in ok if r.ttft is not None]
    long_ttfts = [r.ttft * 1e3 for r in longs if r.ok and r.ttft is not None]
    tokens = sum(r.output_tokens for r in chats + longs if r.ok)
    errors = sum(not r.ok for r in chats + longs)
    p = lambda xs, q: percentile(xs, q) if xs else float("nan")  # noqa: E731
    first_error = next((r.error for r in chats + longs if not r.ok), None)
    return LoadReport(layout, long_rate, len(chats), len(longs), errors, p(tpots, 50), p(tpots, 99), p(ttfts, 50),
                      p(ttfts, 99), p(long_ttfts, 50), tokens / wall if wall else 0.0, first_error)


async def _run(cfg: ABConfig, urls: list[str], rate: float, seed: int, layout: str) -> LoadReport:
    """One run: requests go to the least loaded of `urls` (the two colocated replicas, or the one PD router)."""
    in_flight = dict.fromkeys(urls, 0)
    async with httpx.AsyncClient(timeout=600) as client:
        async def send(body: dict) -> RequestResult:
            url = min(in_flight, key=in_flight.__getitem__)
            in_flight[url] += 1
            try:
                return await run_one(client, url, body)
            finally:
                in_flight[url] -= 1
        chats, longs, wall = await _load(cfg, send, rate, seed)
    return _report(layout, rate, chats, longs, wall)


def _router(cfg: ABConfig, prefill: str, decode: str, cores: list[int], log_dir: Path) -> ServerSpec:
    port = free_port()
    pin = ["taskset", "-c", ",".join(map(str, cores))] if shutil.which("taskset") and cores else []
    argv = [*pin, sys.executable, "-m", "mlc.cli.main", "pd-router", "--prefill", prefill, "--decode", decode,
            "--port", str(port), "--threshold", str(cfg.threshold_tokens)]
    return ServerSpec("mlc pd-router", argv, port, log_dir / f"pd-router-{port}.log")


def run_ab(cfg: ABConfig, log_dir: Path, on_report: Any = None) -> list[LoadReport]:
    half = max(1, len(cfg.cores) // 2)
    a, b = cfg.cores[:half], cfg.cores[half:] or cfg.cores[:half]
    reports: list[LoadReport] = []
    for layout, (role_a, role_b) in (("colocated", ("both", "both")), ("1P+1D", ("prefill", "decode"))):
        with RunningServer(_server(cfg, role_a, a, log_dir)) as sa, \
                RunningServer(_server(cfg, role_b, b, log_dir)) as sb:
            with contextlib.ExitStack() as stack:
                urls = [sa.spec.url, sb.spec.url]
                if layout != "colocated":  # the router shares the decode instance's cores
                    urls = [stack.enter_context(RunningServer(_router(cfg, urls[0], urls[1], b, log_dir))).spec.url]
                for seed, rate in enumerate((0.0, *cfg.long_rates)):
                    report = asyncio.run(_run(cfg, urls, rate, seed, layout))
                    reports.append(report)
                    if on_report is not None:
                        on_report(report)
    return reports


def long_share(r: LoadReport) -> float:
    """The share of a run's requests that were long prompts."""
    return r.longs / (r.chats + r.longs) if r.chats + r.longs else 0.0


def ab_plot(reports: list[LoadReport], path: Path, title: str) -> Path:
    """The short chats' decode TPOT p99 against the share of long prompts, one line per layout."""
    from mlc.bench.plots import finish_axes, pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for i, layout in enumerate(dict.fromkeys(r.layout for r in reports)):
        points = sorted((100 * long_share(r), r.chat_tpot_p99_ms) for r in reports
                        if r.layout == layout and r.chat_tpot_p99_ms == r.chat_tpot_p99_ms)
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=layout)
            for x, y in points:  # the first layout's figures above its points, the second's below
                ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=(0, 6 if i % 2 == 0 else -13),
                            ha="center", fontsize=8)
    ax.set_yscale("log")  # a stalled layout's p99 is seconds where the other's is milliseconds
    return finish_axes(plt, fig, ax, path, title, "long prompts, % of requests",
                   "short chats' decode TPOT p99 (ms, log scale)")
