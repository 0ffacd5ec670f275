"""`--api-lenient` (config key `api_lenient`): a body field the API does not know is ignored instead of refused, as
vLLM does. The request is validated as sent; if the only problems are unknown fields, they are dropped and the body
is validated again. The dropped fields are named in the `x-mlc-ignored-fields` header and logged. Without the flag
(the default) an unknown field stays a 400 with a "did you mean", so a typo such as `max_token` is not lost silently.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.types import Message

log = logging.getLogger("mlc.server")

IGNORED_HEADER = "x-mlc-ignored-fields"
UNKNOWN = "extra_forbidden"


def drop_fields(body: Any, locs: list[tuple]) -> list[str]:
    """Remove the fields at `locs` (pydantic locations under "body", union tags skipped) from `body`; their paths."""
    dropped = []
    for loc in locs:
        path = [p for p in loc[1:] if isinstance(p, int) or p in _keys_on_path(body, loc[1:])]
        parent = body
        for step in path[:-1]:
            parent = parent[step]
        if isinstance(parent, dict) and path and path[-1] in parent:
            del parent[path[-1]]
            dropped.append("".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip("."))
    return dropped


def _keys_on_path(body: Any, loc: tuple) -> set:
    """The dict keys met walking `loc` through `body` (pydantic adds union member tags that are not keys)."""
    keys, node = set(), body
    for p in loc:
        if isinstance(node, dict) and p in node:
            keys.add(p)
            node = node[p]
        elif isinstance(node, list) and isinstance(p, int) and p < len(node):
            node = node[p]
    return keys


class LenientRoute(APIRoute):
    """A route that, with the server's api_lenient on, answers a body whose only faults are unknown fields as if
    they were absent."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                if not request.app.state.mlc.config.api_lenient or not e.errors() \
                        or any(err.get("type") != UNKNOWN for err in e.errors()):
                    raise
                body = await request.json()
                dropped = drop_fields(body, [tuple(err["loc"]) for err in e.errors()])
                if not dropped:
                    raise
                log.info("%s: ignored unknown field(s) %s (--api-lenient)", request.url.path, ", ".join(dropped))
                replay = _replay(json.dumps(body).encode(), request.receive)
                response = await handler(Request(request.scope, replay))
                response.headers[IGNORED_HEADER] = ",".join(dropped)
                return response

        return run


def _replay(data: bytes, then: Callable[[], Awaitable[Message]]) -> Callable[[], Awaitable[Message]]:
    """A receive that gives `data` as the body once, then the connection's own messages (its disconnect)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return await then()
        sent = True
        return {"type": "http.request", "body": data, "more_body": False}

    return receive
