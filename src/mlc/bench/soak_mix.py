"""The traffic of `bench soak`: every kind of request the API serves, drawn at random with fixed weights, each sent
and timed by one coroutine. Faults are injected on purpose (a client that drops a stream midway, a client whose
read timeout cuts the request, a malformed body) and marked so, so that their errors are told apart from the
server's."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "Explain what a hash map is.",
             "Write a haiku about autumn.", "How many legs does a spider have?", "What does HTTP stand for?",
             "Give me a synonym for quick.", "Summarize the plot of a heist film in two sentences."]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
          "required": ["answer", "confidence"]}

# kind -> weight; the faults ("abort", "client_timeout", "malformed") are the injected ones
WEIGHTS = {"chat_stream": 20, "chat": 10, "tools": 8, "tool_choice_named": 4, "json_schema": 6, "n2": 5,
           "logprobs": 6, "echo": 5, "stop": 6, "prefix": 12, "long": 2, "lora": 8, "abort": 5, "client_timeout": 3,
           "malformed": 3}
INJECTED = ("abort", "client_timeout", "malformed")
CLIENT_DEADLINE_S = 0.5
STREAM = {"stream": True, "stream_options": {"include_usage": True}}


@dataclass
class Outcome:
    kind: str
    start: float  # monotonic seconds since the soak began
    status: int  # HTTP status; 0 for a transport error
    e2e: float
    ttft: float | None = None
    tpot: float | None = None
    tokens: int = 0
    error: str | None = None
    injected: bool = False


@dataclass
class MixContext:
    model: str
    context: int  # the server's max_model_len
    shared_system: str  # the prefix-sharing kind's system prompt
    long_text: str  # near the context limit
    lora: str | None = None
    weights: dict[str, int] = field(default_factory=lambda: dict(WEIGHTS))

    def choose(self, rng: random.Random) -> str:
        kinds = [k for k, w in self.weights.items() if w > 0 and (k != "lora" or self.lora)]
        return rng.choices(kinds, [self.weights[k] for k in kinds])[0]


def body_for(kind: str, ctx: MixContext, rng: random.Random) -> tuple[str, dict]:
    """(path, JSON body) of one request of `kind`."""
    q = rng.choice(QUESTIONS)
    chat = {"model": ctx.model, "messages": [{"role": "user", "content": q}], "max_tokens": 32,
            "temperature": 0.0}
    if kind in ("chat_stream", "abort", "client_timeout"):
        return "/v1/chat/completions", {**chat, **STREAM, "max_tokens": 64 if kind != "chat_stream" else 32}
    if kind == "chat":
        return "/v1/chat/completions", chat
    if kind == "tools":
        return "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                                        "tools": TOOLS, "tool_choice": rng.choice(["auto", "required"])}
    if kind == "tool_choice_named":
        return "/v1/chat/completions", {**chat, "tools": TOOLS, **STREAM,
                                        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    if kind == "json_schema":
        return "/v1/chat/completions", {**chat, "max_tokens": 64, "response_format": {
            "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}}
    if kind == "n2":
        return "/v1/chat/completions", {**chat, "n": 2, "temperature": 0.8, "seed": rng.randrange(1 << 30)}
    if kind == "logprobs":
        return "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 3}
    if kind == "echo":
        return "/v1/completions", {"model": ctx.model, "prompt": q, "max_tokens": 16, "echo": True, "logprobs": 2}
    if kind == "stop":
        return "/v1/chat/completions", {**chat, "stop": [".", "\n"], "max_tokens": 48}
    if kind == "prefix":
        return "/v1/chat/completions", {**chat, **STREAM, "messages": [
            {"role": "system", "content": ctx.shared_system}, {"role": "user", "content": q}]}
    if kind == "long":
        return "/v1/completions", {"model": ctx.model, "prompt": ctx.long_text, "max_tokens": 16,
                                   "temperature": 0.0}
    if kind == "lora":
        return "/v1/chat/completions", {**chat, "model": ctx.lora}
    if kind == "malformed":
        return "/v1/chat/completions", {"model": ctx.model, "messages": "not a list", "max_tokens": -3}
    raise ValueError(f"unknown request kind {kind}")


async def send(client: httpx.AsyncClient, url: str, kind: str, ctx: MixContext, rng: random.Random,
               t0: float) -> Outcome:
    """One request of `kind`; an injected fault behaves as that kind of client does."""
    path, body = body_for(kind, ctx, rng)
    start = time.monotonic()
    out = Outcome(kind, start - t0, 0, 0.0, injected=kind in INJECTED)
    timeout = httpx.Timeout(600.0)
    try:
        if kind == "client_timeout":  # a client whose deadline passes mid-stream drops it
            await asyncio.wait_for(_stream(client, url + path, {**body, "max_tokens": 256}, out, start, timeout,
                                           None), CLIENT_DEADLINE_S)
        elif body.get("stream"):
            await _stream(client, url + path, body, out, start, timeout, cut_after=3 if kind == "abort" else None)
        else:
            r = await client.post(url + path, json=body, timeout=timeout)
            out.status = r.status_code
            if r.status_code == 200:
                usage = r.json().get("usage") or {}
                out.tokens = int(usage.get("completion_tokens") or 0)
            else:
                out.error = r.text[:200]
    except TimeoutError:
        out.error = f"the client's {CLIENT_DEADLINE_S} s deadline passed"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
    out.e2e = time.monotonic() - start
    if out.ttft is not None and out.tokens > 1:
        out.tpot = (out.e2e - out.ttft) / (out.tokens - 1)
    return out


async def _stream(client: httpx.AsyncClient, url: str, body: dict, out: Outcome, start: float,
                  timeout: httpx.Timeout, cut_after: int | None) -> None:
    events = 0
    async with client.stream("POST", url, json=body, timeout=timeout) as r:
        out.status = r.status_code
        if r.status_code != 200:
            out.error = (await r.aread()).decode("utf-8", "replace")[:200]
            return
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                out.error = str(event["error"])[:200]
                return
            if out.ttft is None and event.get("choices"):
                out.ttft = time.monotonic() - start
            if event.get("usage"):
                out.tokens = int(event["usage"].get("completion_tokens") or 0)
            events += 1
            if cut_after is not None and events >= cut_after:
                return  # the client walks away mid-stream: the server must free the request's pages


async def closed_loop(url: str, ctx: MixContext, concurrency: int, seconds: float, seed: int) -> float:
    """Requests/s the server completes with `concurrency` clients sending the mix (faults left out) back to back:
    the saturation the soak's default rate is a share of."""
    rng = random.Random(seed)
    mix = MixContext(**{**vars(ctx), "weights": {k: (0 if k in INJECTED else w) for k, w in ctx.weights.items()}})
    done = 0
    t0 = time.monotonic()

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal done
        while time.monotonic() - t0 < seconds:
            o = await send(client, url, mix.choose(rng), mix, rng, t0)
            done += o.status == 200
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 2)) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return done / (time.monotonic() - t0)
