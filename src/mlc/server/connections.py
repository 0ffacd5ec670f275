"""Slow and idle clients: the HTTP protocol the server runs under uvicorn, with deadlines on what a client sends.

uvicorn closes a keep-alive connection that stays idle after a response (`timeout_keep_alive`), and refuses new
requests (503) past `limit_concurrency`; it has no deadline for a request's head or body, so a client that sends
a header line every few seconds (slowloris), or a body a byte at a time, holds its connection, and a task, for
ever. `guarded_protocol` adds both, on uvicorn's httptools protocol:

  head   from the connection's start (or the first byte of a next request on a keep-alive connection) until the
         request line and every header have arrived: `header_timeout_s`;
  body   from the end of the head until the whole body has arrived: `body_timeout_s`.

A connection past either deadline is closed (a route waiting on the body sees a disconnect), logged with the
client's address and counted (`on_close`, the server's `mlc:connections_closed{reason}`). Responses are not timed
here: a client that reads a stream slowly slows only its own stream (the transport's flow control pauses that
response's writes; the engine and the other requests go on), and `request_timeout_s` bounds the request itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("mlc.server")


def guarded_protocol(header_timeout_s: float, body_timeout_s: float,
                     on_close: Callable[[str], None] | None = None) -> type | None:
    """uvicorn's httptools protocol with the head and body deadlines; None where httptools is not installed (then
    uvicorn's own protocol runs without them, and the caller says so)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None

        def _arm(self, seconds: float, what: str) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expired, what, seconds)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self, what: str, seconds: float) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            log.warning("closed the connection from %s: its request %s did not arrive within %.0f s "
                        "(--%s-timeout)", client, what, seconds, "header" if what == "head" else "body")
            if on_close is not None:
                on_close(f"{what}_timeout")
            self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm(header_timeout_s, "head")

        def data_received(self, data: bytes) -> None:
            if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
                self._arm(header_timeout_s, "head")  # the next request on a keep-alive connection begins
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._arm(body_timeout_s, "body")
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedHttpToolsProtocol
