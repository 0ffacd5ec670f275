"""One HTTP request carried from the gateway to a replica and run there through the server's own ASGI app, its
response coming back as it is produced: first the status and headers, then the body chunks (SSE events included).

If the caller stops reading (the client went away), the app sees `http.disconnect`, exactly as under uvicorn, and
the server aborts the engine request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message


@dataclass
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None
    scheme: str = "http"
    http_version: str = "1.1"
    server: tuple[str, int] | None = None
    affinity: tuple[str, ...] = field(default=())  # prefix chunk hashes, read by the router

    @classmethod
    def from_scope(cls, scope: Mapping[str, Any], body: bytes, affinity: tuple[str, ...] = ()) -> ForwardedRequest:
        client = scope.get("client")
        server = scope.get("server")
        return cls(scope["method"], scope["path"], scope.get("query_string", b""),
                   [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])], body,
                   tuple(client) if client else None, scope.get("scheme", "http"), scope.get("http_version", "1.1"),
                   tuple(server) if server else None, affinity)

    def scope(self) -> dict:
        return {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": self.http_version,
            "method": self.method, "scheme": self.scheme, "path": self.path, "raw_path": self.path.encode(),
            "root_path": "", "query_string": self.query_string, "headers": list(self.headers),
            "client": self.client, "server": self.server,
        }


@dataclass
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]]
    replica: str = ""


async def run_asgi(app: ASGIApp, request: ForwardedRequest, replica: str = "") -> AsyncIterator[ResponseStart | bytes]:
    """Yield the response's start, then its body chunks, until the app sends the last one."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_read = False

    async def receive() -> Message:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    async def run_app() -> None:  # an ASGI app is typed as returning an Awaitable, create_task needs a coroutine
        await app(request.scope(), receive, send)

    task = asyncio.create_task(run_app())
    task.add_done_callback(lambda _: sent.put_nowait(None))
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], [(bytes(k), bytes(v)) for k, v in message.get("headers", [])],
                                    replica)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        error = task.exception() if task.done() else None
        if error is not None:
            raise error
    finally:
        gone.set()  # a caller that stopped early is a client that went away
        if not task.done():
            await asyncio.wait({task})  # the app's own cleanup (audit record, freed pages) runs to its end
