"""Prefill/decode disaggregation on the server: the `--kv-role` of an instance, the connector's side channel, and the
headers that carry a request's KV handle.

A prefill instance (`prefill` or `both`) answers a request sent with `x-mlc-kv-prefill: 1` by computing its prompt
and first token only; its response carries `x-mlc-kv-handle` (base64 JSON: request id, prompt tokens, first token,
page ids per KV group, the instance's gloo store) and the pages stay leased (`--kv-lease-timeout`). A decode instance
(`decode` or `both`) given the same request with that handle in `x-mlc-kv-handle` reserves pages, pulls the others
over gloo (`POST /v1/kv/pull` on P asks for them, `POST /v1/kv/release` ends the lease) and continues from P's first
token; a transfer that fails or a handle that does not fit makes it compute the prompt itself. Any API works (native,
OpenAI, Responses, Messages): the headers ride beside the body, which is the client's own.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import socket
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import APIRouter, Request, Security
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlc.engine.kv_transfer import KVHandle, PendingImport, pack_bytes
from mlc.engine.kv_transport import KVReceiver, KVSender
from mlc.errors import InvalidRequestError
from mlc.server.bearer import bearer_scheme
from mlc.server.errors import error_body
from mlc.server.state import loaded_engine

if TYPE_CHECKING:
    import torch

    from mlc.engine.async_engine import AsyncEngine
    from mlc.server.state import ServerState

log = logging.getLogger("mlc.server")

PREFILL_HEADER = "x-mlc-kv-prefill"
HANDLE_HEADER = "x-mlc-kv-handle"
TOKEN_HEADER = "x-mlc-kv-token"  # a deployment's side channel (cluster/pd_side.py): the token its replicas share
ROLES = ("both", "prefill", "decode")


@dataclass
class KVExchange:
    """One HTTP request's part in a transfer (a context variable: every Generation it starts sees it)."""

    prefill: bool = False
    handle_in: KVHandle | None = None
    handle_out: dict[str, Any] | None = None
    claimed: bool = False  # the first Generation of the request takes part; others (n prompts) run as usual

    def claim(self) -> bool:
        first, self.claimed = not self.claimed, True
        return first


def exchange_for_generation() -> KVExchange | None:
    """The request's transfer, for the one Generation that takes part in it."""
    exchange = EXCHANGE.get()
    return exchange if exchange is not None and exchange.claim() else None


EXCHANGE: ContextVar[KVExchange | None] = ContextVar("mlc_kv_exchange", default=None)


def encode_handle(handle: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(handle).encode()).decode()


def decode_handle(value: str) -> KVHandle:
    try:
        return KVHandle.from_dict(json.loads(base64.urlsafe_b64decode(value.encode())))
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(f"the {HANDLE_HEADER} header is not a KV handle ({e}); pass the one the prefill "
                                  "instance returned", field=HANDLE_HEADER) from e


def advertised_host(host: str) -> str:
    return socket.gethostbyname(socket.gethostname()) if host in ("0.0.0.0", "::", "") else host


def attach_pd(state: ServerState, engine: AsyncEngine) -> None:
    """`state.on_ready`'s hook: the connector's ends for the server's role, on the loaded engine."""
    state.pd = PD(state.config.kv_role, state.config.host, state.config.engine.kv_lease_timeout)
    state.pd.attach(engine)


class PD:
    """A server's connector ends: the sender (prefill roles) and the receiver (decode roles)."""

    def __init__(self, role: str, host: str, timeout: float) -> None:
        self.role, self.host = role, host
        self.side_url: str | None = None  # where decode instances pull from, when not this server's own URL
        self.token: str | None = None  # sent with every pull and release (a deployment's side channel checks it)
        self._sender: KVSender | None = None
        self.receiver = KVReceiver(advertised_host(host), timeout) if role in ("decode", "both") else None
        self.timeout = timeout

    @property
    def sender(self) -> KVSender | None:
        """The prefill roles' gloo store and pair groups, opened with the first prefill that asks for them."""
        if self._sender is None and self.role in ("prefill", "both"):
            self._sender = KVSender(advertised_host(self.host), 0, self.timeout)
        return self._sender

    def attach(self, engine: AsyncEngine) -> None:
        if self.receiver is not None:
            engine.kv_puller = lambda pending: self.pull(engine, pending)

    def pull(self, engine: AsyncEngine, pending: PendingImport) -> torch.Tensor:
        """D, on a pull thread: ask P for the pages past D's prefix hit, receive them, end P's lease."""
        assert self.receiver is not None
        handle = pending.handle
        if not handle.address or not handle.store:
            raise ValueError("the KV handle names no prefill instance")
        num_bytes = engine.submit(lambda e: pack_bytes(e.kv_cache, len(pending.src_pages))).result(self.timeout)
        headers = {TOKEN_HEADER: self.token} if self.token else {}
        with self.receiver.lock(handle.store), httpx.Client(timeout=self.timeout, headers=headers) as client:
            tag = self.receiver.next_tag()
            r = client.post(f"{handle.address}/v1/kv/pull", json={
                "request_id": handle.request_id, "pair": self.receiver.pair_id(handle.store), "tag": tag,
                "skip_pages": pending.hit_pages})
            r.raise_for_status()
            if r.json()["bytes"] != num_bytes:
                raise ValueError(f"the prefill instance sends {r.json()['bytes']} bytes, {num_bytes} expected")
            buf = self.receiver.recv(handle.store, tag, num_bytes)
            try:
                client.post(f"{handle.address}/v1/kv/release", json={"request_id": handle.request_id})
            except httpx.HTTPError as e:  # the lease expires by itself
                log.warning("could not release the KV lease of %s: %s", handle.request_id, e)
        return buf


class PDMiddleware:
    """Reads the transfer headers into `EXCHANGE`; puts a prefill's handle on its response."""

    def __init__(self, app: ASGIApp, role: str) -> None:
        self.app, self.role = app, role

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        prefill = headers.get(PREFILL_HEADER, "") in ("1", "true")
        handle = headers.get(HANDLE_HEADER)
        problem = None
        if prefill and self.role == "decode":
            problem = "this instance runs with --kv-role decode: send prefills to a prefill instance"
        elif handle and self.role == "prefill":
            problem = "this instance runs with --kv-role prefill: send KV handles to a decode instance"
        if problem is not None:
            body = error_body(problem, "invalid_request_error", PREFILL_HEADER if prefill else HANDLE_HEADER,
                              "wrong_kv_role")
            await JSONResponse(body, 400)(scope, receive, send)
            return
        if not prefill and not handle:
            await self.app(scope, receive, send)
            return
        try:
            exchange = KVExchange(prefill, decode_handle(handle) if handle else None)
        except InvalidRequestError as e:
            await JSONResponse(error_body(e.message, "invalid_request_error", HANDLE_HEADER), 400)(scope, receive,
                                                                                                 send)
            return

        async def send_handle(message: Message) -> None:
            if message["type"] == "http.response.start" and exchange.handle_out is not None:
                header = (HANDLE_HEADER.encode(), encode_handle(exchange.handle_out).encode())
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        token = EXCHANGE.set(exchange)
        try:
            await self.app(scope, receive, send_handle)
        finally:
            EXCHANGE.reset(token)


async def finish_prefill(state: ServerState, request_id: str) -> None:
    """After a held prefill ended: its handle for the response header (none if the lease was not made)."""
    exchange = EXCHANGE.get()
    pd = state.pd
    if exchange is None or not exchange.prefill or pd is None or pd.sender is None:
        return
    handle = await asyncio.wrap_future(loaded_engine(state).submit(lambda e: e.kv_handle(request_id)))
    if handle is not None:
        handle.store = pd.sender.address
        if pd.side_url:  # a deployed replica: decode replicas reach it there, not through the gateway
            handle.address = pd.side_url
        exchange.handle_out = handle.to_dict()


router = APIRouter(tags=["kv transfer"], dependencies=[Security(bearer_scheme)])


class PullBody(BaseModel):
    request_id: str
    pair: str
    tag: int
    skip_pages: int = 0


class ReleaseBody(BaseModel):
    request_id: str


def _sender(request: Request) -> tuple[ServerState, KVSender]:
    state: ServerState = request.app.state.mlc
    state.require_engine()
    pd = state.pd
    if pd is None or pd.sender is None:
        raise InvalidRequestError("this instance does not run a prefill role (--kv-role prefill or both)",
                                  field="kv_role")
    return state, pd.sender


@router.post("/v1/kv/pull", summary="Send a leased prompt's KV pages to a decode instance (the connector)")
async def pull(body: PullBody, request: Request):
    state, sender = _sender(request)
    try:
        buf = await asyncio.wrap_future(loaded_engine(state).submit(lambda e: e.export_kv(body.request_id,
                                                                                        body.skip_pages)))
    except KeyError:
        return JSONResponse(error_body(f"no KV lease for {body.request_id!r} (expired or released); compute the "
                                       "prompt on the decode instance", "invalid_request_error", "request_id",
                                       "kv_lease_gone"), 410)
    sender.send(body.pair, body.tag, buf)
    return {"bytes": buf.numel()}


@router.post("/v1/kv/release", summary="End a KV lease (the decode instance pulled the pages)")
async def release(body: ReleaseBody, request: Request):
    state, _ = _sender(request)
    released = await asyncio.wrap_future(loaded_engine(state).submit(lambda e: e.release_kv(body.request_id)))
    return {"released": released}
