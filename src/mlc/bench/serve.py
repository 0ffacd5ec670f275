"""Load a running OpenAI-compatible server with streaming chat completions and measure it (vLLM's `bench serve`):
TTFT, TPOT, ITL and end-to-end latency (mean/p50/p99), output tokens/s, requests/s, goodput under SLOs, failures.

Works against any server that speaks `/v1/chat/completions` with `stream: true` (mlc, vLLM, llama.cpp, OpenAI).
A 200 answer that carries no token counts as a failure: an empty completion is never a success.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from mlc.bench.prompts import as_conversation, read_prompt_rows
from mlc.bench.stats import Summary, summarize
from mlc.errors import InvalidRequestError

BUILTIN_PROMPTS = [
    "Explain what a KV cache is in two sentences.",
    "Write a haiku about autumn rain.",
    "List five uses for a paperclip.",
    "What is the difference between a list and a tuple in Python?",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "Give me a recipe for a simple tomato soup.",
    "Why is the sky blue? Answer for a ten-year-old.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Write a short motivational message for a student before an exam.",
    "What are the main causes of inflation?",
    "Describe a cat to someone who has never seen one.",
    "Suggest three names for a bakery.",
    "How does a binary search work?",
    "Write a limerick about a programmer.",
    "What should I pack for a weekend hiking trip?",
    "Explain photosynthesis briefly.",
    "Compose a polite email declining a meeting invitation.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Give three tips for better sleep.",
    "Write the opening line of a mystery novel.",
    "How do vaccines train the immune system?",
    "Compare electric cars and petrol cars in a few points.",
    "What is a prime number? Give examples.",
    "Tell me a fun fact about octopuses.",
]


@dataclass
class BenchConfig:
    url: str
    concurrency: list[int]
    num_prompts: int
    max_tokens: int = 128
    dataset: str = "builtin"
    model: str | None = None
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    timeout_s: float = 600.0
    warmup: int = 1
    seed: int = 0
    request_rate: float | None = None  # requests/s as a Poisson process (None: all at once, as concurrency allows)
    api: str = "chat"  # which API the requests go to: chat (completions), responses, messages (Anthropic)


API_PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


@dataclass
class RequestResult:
    ok: bool
    e2e: float
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class LevelReport:
    concurrency: int
    num_prompts: int
    duration_s: float
    completed: int
    failed: int
    ttft_ms: Summary
    tpot_ms: Summary
    itl_ms: Summary
    e2e_ms: Summary
    output_tokens: int
    prompt_tokens: int
    output_tok_s: float
    request_throughput: float
    goodput: float | None
    errors: list[str]
    samples_ms: dict[str, list[float]] = field(default_factory=dict)  # "ttft", "e2e": one value per completed request

    def as_dict(self) -> dict:
        out = {k: getattr(self, k) for k in ("concurrency", "num_prompts", "duration_s", "completed", "failed",
                                              "output_tokens", "prompt_tokens", "output_tok_s",
                                              "request_throughput", "goodput", "errors", "samples_ms")}
        for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            out[k] = getattr(self, k).as_dict()
        return out


def base_url(url: str) -> str:
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise InvalidRequestError(f"--url {url!r} must start with http:// or https://", field="url")
    return url.removesuffix("/v1")


def load_prompts(dataset: str) -> list[list[dict]]:
    """Conversations to send: the built-in prompts, or a JSONL file of {"prompt": ...} or {"messages": [...]}."""
    if dataset == "builtin":
        return [[{"role": "user", "content": p}] for p in BUILTIN_PROMPTS]
    return [as_conversation(row) for row in read_prompt_rows(dataset, "--dataset")]


async def discover_model(client: httpx.AsyncClient, url: str) -> str:
    try:
        r = await client.get(f"{url}/v1/models")
    except httpx.HTTPError as e:
        raise InvalidRequestError(f"cannot reach {url}/v1/models ({e}); is the server running?") from None
    if r.status_code != 200:
        raise InvalidRequestError(f"{url}/v1/models answered {r.status_code}: {r.text[:200]}; pass --model or "
                                  "--api-key")
    data = r.json().get("data") or []
    if not data:
        raise InvalidRequestError(f"{url}/v1/models lists no model; pass --model")
    return data[0]["id"]


def _body(cfg: BenchConfig, model: str, messages: list[dict]) -> dict:
    if cfg.api == "responses":
        return {"model": model, "input": messages, "max_output_tokens": cfg.max_tokens,
                "temperature": cfg.temperature, "stream": True, "store": False}
    if cfg.api == "messages":
        return {"model": model, "messages": messages, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
                "stream": True}
    body = {"model": model, "messages": messages, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # vLLM / mlc extension: every request generates max_tokens
    return body


def read_event(api: str, event: dict, usage: dict[str, int | None]) -> tuple[bool, str | None]:
    """(whether this streamed event carries output text, an error message); token counts go into `usage` as chat's
    `completion_tokens` / `prompt_tokens`."""
    kind = event.get("type")
    if api == "responses":
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            got = (event.get("response") or {}).get("usage") or {}
            usage.update(completion_tokens=got.get("output_tokens"), prompt_tokens=got.get("input_tokens"))
        error = event.get("message") or (event.get("error") or {}).get("message") if kind == "error" else None
        return kind == "response.output_text.delta" and bool(event.get("delta")), error
    if api == "messages":
        if kind == "message_start":
            usage["prompt_tokens"] = ((event.get("message") or {}).get("usage") or {}).get("input_tokens")
        elif kind == "message_delta":
            usage["completion_tokens"] = (event.get("usage") or {}).get("output_tokens")
        delta = event.get("delta") or {}
        error = (event.get("error") or {}).get("message") if kind == "error" else None
        return kind == "content_block_delta" and delta.get("type") == "text_delta" and bool(delta.get("text")), error
    usage.update(event.get("usage") or {})
    error = (event.get("error") or {}).get("message") if event.get("error") else None
    return any((c.get("delta") or {}).get("content") for c in event.get("choices") or []), error


async def run_one(client: httpx.AsyncClient, url: str, body: dict, api: str = "chat") -> RequestResult:
    start = time.perf_counter()
    ttft: float | None = None
    last: float | None = None  # when the latest content chunk came
    itl: list[float] = []
    chunks = 0
    usage: dict[str, int | None] = {}
    try:
        async with client.stream("POST", url + API_PATHS[api], json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace")
                return RequestResult(False, time.perf_counter() - start, error=f"HTTP {r.status_code}: {text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                has_text, error = read_event(api, json.loads(data), usage)
                if error is not None:
                    return RequestResult(False, time.perf_counter() - start, error=f"stream error: {error}")
                if has_text:
                    now = time.perf_counter()
                    if last is None:
                        ttft = now - start
                    else:
                        itl.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestResult(False, time.perf_counter() - start, error=f"{type(e).__name__}: {e}")
    e2e = time.perf_counter() - start
    tokens = usage.get("completion_tokens") or chunks
    if ttft is None or tokens == 0:
        return RequestResult(False, e2e, error="HTTP 200 with an empty completion")
    return RequestResult(True, e2e, ttft, itl, tokens, usage.get("prompt_tokens") or 0)


def _good(r: RequestResult, cfg: BenchConfig) -> bool:
    if cfg.slo_ttft_ms is not None and (r.ttft is None or r.ttft * 1000 > cfg.slo_ttft_ms):
        return False
    tpot = r.tpot
    return cfg.slo_tpot_ms is None or tpot is None or tpot * 1000 <= cfg.slo_tpot_ms


def report(concurrency: int, results: list[RequestResult], duration: float, cfg: BenchConfig) -> LevelReport:
    ok = [r for r in results if r.ok]
    has_slo = cfg.slo_ttft_ms is not None or cfg.slo_tpot_ms is not None
    out_tokens = sum(r.output_tokens for r in ok)
    errors = list(dict.fromkeys(r.error for r in results if r.error))[:5]
    return LevelReport(
        concurrency=concurrency, num_prompts=len(results), duration_s=duration, completed=len(ok),
        failed=len(results) - len(ok),
        ttft_ms=summarize([r.ttft for r in ok if r.ttft is not None]).scaled(1000),  # every completed one has it
        tpot_ms=summarize([r.tpot for r in ok if r.tpot is not None]).scaled(1000),
        itl_ms=summarize([x for r in ok for x in r.itl]).scaled(1000),
        e2e_ms=summarize([r.e2e for r in ok]).scaled(1000),
        output_tokens=out_tokens, prompt_tokens=sum(r.prompt_tokens for r in ok),
        output_tok_s=out_tokens / duration if duration else 0.0,
        request_throughput=len(ok) / duration if duration else 0.0,
        goodput=sum(_good(r, cfg) for r in ok) / duration if has_slo and duration else None,
        errors=errors,
        samples_ms={"ttft": [r.ttft * 1000 for r in ok if r.ttft is not None], "e2e": [r.e2e * 1000 for r in ok]},
    )


def arrival_gaps(n: int, rate: float | None, seed: int) -> list[float]:
    """Seconds to wait before each of `n` requests: exponential gaps (a Poisson process) at `rate` per second, the
    first at once; all zeros without a rate."""
    if not rate:
        return [0.0] * n
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(rate) for _ in range(n - 1)]


async def run_level(client: httpx.AsyncClient, url: str, bodies: list[dict], concurrency: int,
                    cfg: BenchConfig, on_request=None) -> LevelReport:
    """Send `bodies` with at most `concurrency` in flight; with `cfg.request_rate` they also arrive as a Poisson
    process (a request that arrives while `concurrency` are in flight waits for a slot, and its latency counts
    from its arrival). `on_request(result)` is called as each request ends."""
    gate = asyncio.Semaphore(concurrency)

    async def limited(body: dict, arrived: float) -> RequestResult:
        async with gate:
            result = await run_one(client, url, body, cfg.api)
        waited = time.perf_counter() - arrived - result.e2e
        if cfg.request_rate and waited > 0:  # queueing on the client side is part of what the user sees
            result.e2e += waited
            result.ttft = None if result.ttft is None else result.ttft + waited
        if on_request is not None:
            on_request(result)
        return result

    start = time.perf_counter()
    tasks = []
    for body, gap in zip(bodies, arrival_gaps(len(bodies), cfg.request_rate, cfg.seed)):
        if gap:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(limited(body, time.perf_counter())))
    results = await asyncio.gather(*tasks)
    return report(concurrency, list(results), time.perf_counter() - start, cfg)


async def run_bench(cfg: BenchConfig, on_level=None, on_request=None) -> tuple[str, list[LevelReport]]:
    """(model, one report per concurrency level); `on_level(report)` is called as each level finishes and
    `on_request(result)` as each measured request ends."""
    if cfg.num_prompts < 1 or not cfg.concurrency or min(cfg.concurrency) < 1:
        raise InvalidRequestError("--num-prompts and every --concurrency level must be at least 1")
    url = base_url(cfg.url)
    prompts = load_prompts(cfg.dataset)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=max(cfg.concurrency) + 4, max_keepalive_connections=max(cfg.concurrency))
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(cfg.timeout_s), limits=limits) as client:
        model = cfg.model or await discover_model(client, url)
        rng = random.Random(cfg.seed)
        for _ in range(cfg.warmup):
            warm = await run_one(client, url, _body(cfg, model, prompts[0]), cfg.api)
            if not warm.ok:
                raise InvalidRequestError(f"the warm-up request failed: {warm.error}")
        reports = []
        for level in cfg.concurrency:
            bodies = [_body(cfg, model, prompts[rng.randrange(len(prompts))]) for _ in range(cfg.num_prompts)]
            rep = await run_level(client, url, bodies, level, cfg, on_request)
            reports.append(rep)
            if on_level is not None:
                on_level(rep)
    return model, reports


def to_json(cfg: BenchConfig, model: str, reports: list[LevelReport]) -> dict:
    return {
        "url": base_url(cfg.url), "model": model, "dataset": cfg.dataset, "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature, "ignore_eos": cfg.ignore_eos, "api": cfg.api,
        "slo": {"ttft_ms": cfg.slo_ttft_ms, "tpot_ms": cfg.slo_tpot_ms}, "request_rate": cfg.request_rate,
        "levels": [r.as_dict() for r in reports],
    }
