"""The prefill/decode router: one HTTP endpoint in front of prefill instances and decode instances
(`mlc-cli serve --kv-role prefill|decode`, `server/pd.py`).

A generation request whose prompt looks long enough (its body's prompt text over `threshold_tokens` x 4 characters)
goes first to the prefill instance with the fewest requests in flight, as a non-streaming request with
`x-mlc-kv-prefill: 1`; the handle it answers with (P's URL added) goes with the client's unchanged request to the
decode instance with the fewest in flight, whose response (stream or not) is the client's. A shorter prompt, a
prefill that fails, or one that returns no handle goes to the decode instance alone (it prefills itself). Everything
else (models, tokenize, health) goes to a decode instance. A decode instance that dies mid-stream ends that stream
with an error event and `[DONE]`; the router's other requests go on. `GET /metrics` answers the router's own
counters: the requests in flight per pool (its queue depth) and how many went remote or stayed local.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from mlc.server.errors import error_body
from mlc.server.pd import HANDLE_HEADER, PREFILL_HEADER, decode_handle, encode_handle
from mlc.server.protocol.streaming import DONE, sse

log = logging.getLogger("mlc.cluster.pd")

GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
PROMPT_FIELDS = ("prompt", "messages", "input", "text", "system")
CHARS_PER_TOKEN = 4
HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding"}


def prompt_chars(body: dict) -> int:
    """The prompt's size in characters of its JSON (an estimate of its tokens without a tokenizer)."""
    return sum(len(json.dumps(body[k])) for k in PROMPT_FIELDS if k in body)


def generation_body(method: str, path: str, raw: bytes) -> dict | None:
    """The JSON object of a generation request, or None (another route, or a body that is not a JSON object)."""
    if method != "POST" or path not in GENERATION_PATHS:
        return None
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def long_enough(body: dict, threshold_tokens: int) -> bool:
    """Whether a generation request's prompt looks long enough to prefill on a prefill instance."""
    return prompt_chars(body) >= threshold_tokens * CHARS_PER_TOKEN


class PDRouter:
    def __init__(self, prefill: list[str], decode: list[str], threshold_tokens: int = 256,
                 timeout: float = 600.0) -> None:
        if not decode:
            raise ValueError("the PD router needs at least one decode instance (--decode URL)")
        self.prefill = [u.rstrip("/") for u in prefill]
        self.decode = [u.rstrip("/") for u in decode]
        self.threshold_tokens = threshold_tokens
        self.client = httpx.AsyncClient(timeout=timeout)
        self.in_flight: Counter[str] = Counter()
        self.routed: Counter[str] = Counter()  # remote, local, fallback
        self._tie = itertools.count()

    def _pick(self, urls: list[str]) -> str:
        n = next(self._tie)
        return min(urls, key=lambda u: (self.in_flight[u], (urls.index(u) - n) % len(urls)))

    async def __call__(self, scope, receive, send) -> None:
        request = Request(scope, receive)
        if request.url.path == "/metrics" and request.method == "GET":
            response: Response = PlainTextResponse(self.metrics_text())
        else:
            response = await self.route(request)
        await response(scope, receive, send)

    def metrics_text(self) -> str:
        lines = ["# HELP mlc_pd_pool_in_flight Requests the PD router has in flight per pool (its queue depth).",
                 "# TYPE mlc_pd_pool_in_flight gauge"]
        for pool, urls in (("prefill", self.prefill), ("decode", self.decode)):
            lines.append(f'mlc_pd_pool_in_flight{{pool="{pool}"}} {sum(self.in_flight[u] for u in urls)}')
        lines += ["# HELP mlc_pd_routed_total Generation requests by path: remote prefill, local, or fallback.",
                  "# TYPE mlc_pd_routed_total counter"]
        lines += [f'mlc_pd_routed_total{{route="{k}"}} {self.routed[k]}' for k in ("remote", "local", "fallback")]
        return "\n".join(lines) + "\n"

    def _headers(self, request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items()
                if k.lower() not in HOP_HEADERS and k.lower() not in (PREFILL_HEADER, HANDLE_HEADER)}

    async def route(self, request: Request) -> Response:
        raw = await request.body()
        headers = self._headers(request)
        body = generation_body(request.method, request.url.path, raw)
        if body is not None and self.prefill and long_enough(body, self.threshold_tokens):
            handle = await self._prefill(request.url.path, body, headers)
            if handle is not None:
                headers[HANDLE_HEADER] = handle
                self.routed["remote"] += 1
            else:
                self.routed["fallback"] += 1
        elif body is not None:
            self.routed["local"] += 1
        return await self._forward(self._pick(self.decode), request, raw, headers)

    async def _prefill(self, path: str, body: dict, headers: dict[str, str]) -> str | None:
        """The handle of the prompt's prefill on a P instance (P's URL in it), or None."""
        url = self._pick(self.prefill)
        self.in_flight[url] += 1
        try:
            r = await self.client.post(url + path, json={**body, "stream": False},
                                       headers={**headers, PREFILL_HEADER: "1"})
            value = r.headers.get(HANDLE_HEADER)
            if r.status_code != 200 or not value:
                log.warning("prefill on %s gave %d without a KV handle; the decoder prefills", url, r.status_code)
                return None
            handle = decode_handle(value)
            handle.address = url
            return encode_handle(handle.to_dict())
        except (httpx.HTTPError, ValueError) as e:
            log.warning("prefill on %s failed (%s); the decoder prefills", url, e)
            return None
        finally:
            self.in_flight[url] -= 1

    async def _forward(self, url: str, request: Request, raw: bytes, headers: dict[str, str]) -> Response:
        self.in_flight[url] += 1
        try:
            upstream = await self.client.send(self.client.build_request(
                request.method, url + request.url.path, params=request.query_params, content=raw, headers=headers),
                stream=True)
        except httpx.HTTPError as e:
            self.in_flight[url] -= 1
            return JSONResponse(error_body(f"decode instance {url} is unreachable ({e}); retry",
                                           "service_unavailable", None, "no_replica"), 503)

        streaming = upstream.headers.get("content-type", "").startswith("text/event-stream")

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:  # the decode instance died mid-answer: say so in-band
                log.warning("decode instance %s failed mid-response: %s", url, e)
                if streaming:
                    message = f"the decode instance failed mid-stream ({type(e).__name__}); retry the request"
                    yield ("\n" + sse(error_body(message, "service_unavailable", None, "replica_failed"))).encode()
                    yield DONE.encode()
            finally:
                await upstream.aclose()
                self.in_flight[url] -= 1

        keep = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS | {"content-encoding"}}
        return StreamingResponse(body(), upstream.status_code, headers=keep)
