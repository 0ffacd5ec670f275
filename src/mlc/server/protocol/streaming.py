"""Server-sent events and client disconnects.

A client that goes away (stream or not) aborts its engine request: `until_disconnect` races the work against the
connection's `http.disconnect`; for streams, Starlette cancels the body on disconnect and `SSEResponse` then closes
the body iterator and runs its cleanup, so the request's pages are freed before the next engine step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Send

from mlc.server.errors import ClientDisconnected

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"


def sse_event(payload: dict) -> str:
    """An event named by its payload's type (`event: <type>`), as the Responses and Messages APIs stream."""
    return f"event: {payload['type']}\n{sse(payload)}"


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], cleanup: Callable[[], Awaitable[None]],
                 headers: dict[str, str] | None = None):
        super().__init__(events, headers={**SSE_HEADERS, **(headers or {})})
        self._cleanup = cleanup

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await self._cleanup()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """The result of `work`, or ClientDisconnected (with `work` cancelled) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    left = False
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        left = not task.done()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({task})
    if left:
        if not task.cancelled():
            task.exception()  # retrieved: the work's own cancellation error is not news
        raise ClientDisconnected()
    return task.result()
