"""The one HTTP endpoint (the Ray Serve ingress): every request is forwarded unchanged to a replica chosen by the
prefix-affinity router and its response streamed back; `/metrics` answers with all replicas' metrics in one page.

A replica that dies before it starts answering costs nothing: the request goes to another one. One that dies
mid-stream ends that stream with an error event. Bodies over the server's limit get its 413 here already.

With a prefill/decode layout (`cluster/pd_deploy.py`) the replicas are the decode pool's, and a generation request
whose prompt reaches the layout's threshold goes first to a prefill replica (non-streaming, `x-mlc-kv-prefill: 1`);
the KV handle it answers with goes with the client's request to a decode replica, which pulls the pages. A prefill
that fails or gives no handle leaves the decode replica to compute the prompt. Clients' own `x-mlc-kv-*` headers are
dropped: only the gateway hands out KV handles."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mlc.cluster.affinity import affinity_keys
from mlc.cluster.asgi_bridge import ForwardedRequest, ResponseStart
from mlc.cluster.lora_sync import LOAD_PATH, UNLOAD_PATH, record
from mlc.cluster.metrics_merge import gauge, merge
from mlc.cluster.pd_deploy import (
    DECODE_APP,
    DECODE_DEPLOYMENT,
    PREFILL_APP,
    PREFILL_DEPLOYMENT,
    REPLICA_APP,
    REPLICA_DEPLOYMENT,
)
from mlc.cluster.pd_router import generation_body, long_enough
from mlc.server.app import MAX_BODY_BYTES, body_limit_message
from mlc.server.auth import check_authorization
from mlc.server.errors import error_body
from mlc.server.pd import HANDLE_HEADER, PREFILL_HEADER
from mlc.server.protocol.streaming import DONE, sse

log = logging.getLogger("mlc.cluster.gateway")

GATEWAY_APP = "mlc"
GATEWAY_DEPLOYMENT = "MlcGateway"
HEALTH_PATHS = ("/health", "/ready", "/live")
HEALTH_WAIT_S = 5.0
TRIES = 3
KV_HEADER_PREFIX = b"x-mlc-kv-"


def _unavailable(message: str, code: str = "no_replica") -> JSONResponse:
    return JSONResponse(error_body(message, "service_unavailable", None, code), 503, headers={"Retry-After": "2"})


class Gateway:
    def __init__(self, spec: dict):
        from ray import serve

        from mlc.cluster.registry import STALE_S, get_registry

        self.pd = spec.get("pd")  # {"threshold_tokens"} for a prefill/decode layout
        if self.pd is None:
            self.replicas = serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=REPLICA_APP)
        else:
            self.replicas = serve.get_deployment_handle(DECODE_DEPLOYMENT, app_name=DECODE_APP)
            self.prefill = serve.get_deployment_handle(PREFILL_DEPLOYMENT, app_name=PREFILL_APP)
        self.routed: Counter[str] = Counter()  # PD: remote, local, fallback
        self.pool_in_flight: Counter[str] = Counter()
        self.chunk_chars = spec["chunk_chars"]
        self.request_timeout_s = spec["request_timeout_s"]
        self.api_keys = spec["api_keys"]
        self.registry = get_registry()
        self.stale_s = STALE_S

    async def __call__(self, request: Request) -> Response:
        if request.url.path == "/metrics" and request.method == "GET":
            auth = request.headers.get("authorization")
            problem = check_authorization(auth, self.api_keys) if self.api_keys else None
            if problem is None:
                return await self._metrics()
        body = await _read_body(request)
        if body is None:
            message = body_limit_message(MAX_BODY_BYTES)
            return JSONResponse(error_body(message, "invalid_request_error", "body", "body_too_large"), 413,
                                headers={"Connection": "close"})
        affinity = affinity_keys(request.url.path, body, self.chunk_chars)
        fwd = ForwardedRequest.from_scope(request.scope, body, affinity)
        fwd.headers = [(k, v) for k, v in fwd.headers if not k.lower().startswith(KV_HEADER_PREFIX)]
        if self.pd is not None:
            fwd = await self._remote_prefill(fwd)
        return await self._forward(fwd)

    async def _remote_prefill(self, fwd: ForwardedRequest) -> ForwardedRequest:
        """A long enough generation request with a prefill replica's KV handle added (or unchanged: the decode replica
        prefills it itself)."""
        assert self.pd is not None
        body = generation_body(fwd.method, fwd.path, fwd.body)
        if body is None:
            return fwd
        if not long_enough(body, self.pd["threshold_tokens"]):
            self.routed["local"] += 1
            return fwd
        handle = await self._prefill(fwd, body)
        self.routed["remote" if handle is not None else "fallback"] += 1
        if handle is None:
            return fwd
        return replace(fwd, headers=[*fwd.headers, (HANDLE_HEADER.encode(), handle)])

    async def _prefill(self, fwd: ForwardedRequest, body: dict) -> bytes | None:
        raw = json.dumps({**body, "stream": False}).encode()
        headers = [(k, v) for k, v in fwd.headers if k.lower() != b"content-length"]
        headers += [(b"content-length", str(len(raw)).encode()), (PREFILL_HEADER.encode(), b"1")]
        self.pool_in_flight["prefill"] += 1
        try:
            # stream=True: a DeploymentResponseGenerator, which Ray's types cannot tell from a DeploymentResponse
            stream: Any = self.prefill.forward.options(stream=True).remote(replace(fwd, headers=headers, body=raw))
            start = await asyncio.wait_for(stream.__anext__(), self.request_timeout_s)
            async for _ in stream:  # the prefill's own answer (its first token) is not the client's
                pass
        except Exception as e:  # no prefill replica, or it failed: the decode replica computes the prompt
            log.warning("prefill of %s failed (%s: %s); the decode replica prefills", fwd.path, type(e).__name__, e)
            return None
        finally:
            self.pool_in_flight["prefill"] -= 1
        handle = next((v for k, v in start.headers if k.lower() == HANDLE_HEADER.encode()), None)
        if start.status != 200 or handle is None:
            log.warning("prefill of %s answered %d without a KV handle; the decode replica prefills", fwd.path,
                        start.status)
            return None
        return handle

    async def _forward(self, fwd: ForwardedRequest) -> Response:
        wait_s = HEALTH_WAIT_S if fwd.path in HEALTH_PATHS else self.request_timeout_s
        last: BaseException | None = None
        for _ in range(TRIES):
            stream = self.replicas.forward.options(stream=True).remote(fwd)
            try:
                # stream=True: a DeploymentResponseGenerator, which Ray's types cannot tell from a DeploymentResponse
                start = await asyncio.wait_for(stream.__anext__(), wait_s)  # type: ignore[union-attr]
            except asyncio.TimeoutError:
                stream.cancel()
                if fwd.path in HEALTH_PATHS:
                    return JSONResponse({"status": "loading"}, 503)
                return _unavailable(f"no replica took the request within {wait_s:.0f}s; retry later")
            except StopAsyncIteration:
                last = RuntimeError("the replica closed the request without an answer")
                continue
            except Exception as e:  # the replica died before answering: nothing was sent, try another one
                log.warning("replica failed before answering %s %s: %s", fwd.method, fwd.path, e)
                last = e
                continue
            if fwd.path in (LOAD_PATH, UNLOAD_PATH):  # every replica follows a successful one
                await record(self.registry, fwd.path, fwd.body, start.status)
            headers = [h for h in start.headers] + [(b"x-mlc-replica", start.replica.encode())]
            body = self._body(stream, start)
            if self.pd is not None:  # the decode pool's queue depth, which only a PD layout reports
                body = self._counted(body)
            response = StreamingResponse(body, status_code=start.status)
            response.raw_headers = headers
            return response
        return _unavailable(f"the replicas failed before answering ({type(last).__name__}: {last}); retry")

    async def _body(self, stream, start: ResponseStart) -> AsyncIterator[bytes]:
        events = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.headers)
        finished = False
        try:
            async for chunk in stream:
                yield chunk
            finished = True
        except Exception as e:  # the replica died mid-answer
            log.warning("replica %s failed mid-response: %s", start.replica, e)
            if events:
                message = f"the replica serving this stream failed ({type(e).__name__}); retry the request"
                yield sse(error_body(message, "service_unavailable", None, "replica_failed")).encode()
                yield DONE.encode()
        finally:
            if not finished:
                stream.cancel()

    async def _counted(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """`body`, counted in flight until it ends (reported for a PD layout's decode pool)."""
        self.pool_in_flight["decode"] += 1
        try:
            async for chunk in body:
                yield chunk
        finally:
            self.pool_in_flight["decode"] -= 1

    async def _metrics(self) -> Response:
        from mlc.cluster.affinity import DECISIONS

        snapshots = await self.registry.snapshots.remote(self.stale_s) if self.registry is not None else []
        text = merge({s["id"]: s["metrics"] for s in snapshots})
        text += gauge("mlc:replicas", "Replicas posting their state, by status.", _by_status(snapshots))
        if DECISIONS:
            text += gauge("mlc:router_requests", "Requests routed, by prefix-affinity decision.",
                          {(("decision", d),): n for d, n in sorted(DECISIONS.items())}, kind="counter")
        if self.pd is not None:
            text += gauge("mlc:pd_requests", "Generation requests by path: prefilled on a prefill replica (remote), "
                          "on the decode replica (local), or there after a failed prefill (fallback).",
                          {(("route", k),): self.routed[k] for k in ("remote", "local", "fallback")}, kind="counter")
            text += gauge("mlc:pd_pool_in_flight", "Requests the gateway has in flight per pool (its queue depth).",
                          {(("pool", p),): self.pool_in_flight[p] for p in ("prefill", "decode")})
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def _by_status(snapshots: list[dict]) -> dict:
    counts: dict = {}
    for s in snapshots:
        key = (("status", s["status"]),)
        counts[key] = counts.get(key, 0) + 1
    return counts


async def _read_body(request: Request) -> bytes | None:
    """The whole body, or None past the server's limit (without reading the rest)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)
