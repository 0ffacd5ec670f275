"""Bearer-token auth: with keys configured, every route but the open ones needs `Authorization: Bearer <key>`, or
`x-api-key: <key>` as Anthropic's clients send it.

Checked in an ASGI middleware, before the body is read, so an unauthenticated client learns nothing about the API
beyond 401. Failures are logged with the client address and the reason, never with the key that was sent.
"""

from __future__ import annotations

import hmac
import logging
import os
from contextvars import ContextVar

from fastapi.security import HTTPBearer
from starlette.types import ASGIApp, Receive, Scope, Send

from mlc.errors import AuthError
from mlc.server.errors import mlc_error_response
from mlc.server.keys import KeyRing, Match
from mlc.server.observability.audit import audit_info

log = logging.getLogger("mlc.server")

OPEN_PATHS = frozenset({"/health", "/ready", "/live", "/", "/favicon.ico", "/dashboard", "/train"})  # pages: no data
OPEN_PREFIXES = ("/static/",)
ENV_VAR = "MLC_API_KEY"
# who the request's key is, for admission (per-key limits, fairness): set here, read by run_request.start
current_key: ContextVar[Match | None] = ContextVar("mlc_current_key", default=None)

# Documents the scheme in /openapi.json; the middleware does the checking.
bearer_scheme = HTTPBearer(auto_error=False, description="Needed when the server runs with --api-key / MLC_API_KEY.")


def keys_from_env(value: str | None = None) -> list[str]:
    """MLC_API_KEY holds one key or several, comma-separated."""
    raw = os.environ.get(ENV_VAR, "") if value is None else value
    return [k.strip() for k in raw.split(",") if k.strip()]


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def check_authorization(header: str | None, keys: list[str]) -> str | None:
    """None when the header carries one of `keys`; else why not (for the log and the 401 message)."""
    if not header:
        return "no Authorization header"
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return "the Authorization header is not 'Bearer <key>'"
    given = token.strip().encode()
    # compare against every key, so the time taken does not reveal which prefix matched
    ok = [hmac.compare_digest(given, k.encode()) for k in keys]
    return None if any(ok) else "the key is not one of the server's keys"


def _token(header: str | None) -> str | None:
    scheme, _, token = (header or "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: KeyRing):
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys.enabled or is_open(scope["path"]) or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get("authorization")
        token = _token(given) or headers.get("x-api-key")  # Anthropic's clients send the key as x-api-key
        match = self.keys.match(token) if token else None
        if match is not None:
            if match.name is not None:
                audit_info(scope).key_name = match.name
            reset = current_key.set(match)
            try:
                await self.app(scope, receive, send)
            finally:
                current_key.reset(reset)
            return
        problem = check_authorization(given, []) if not token else "the key is not one of the server's keys"
        client = scope.get("client") or ("?", 0)
        log.warning("401 %s %s from %s: %s", scope["method"], scope["path"], client[0], problem)
        err = AuthError(f"unauthorized: {problem}; send 'Authorization: Bearer <key>' (or 'x-api-key: <key>') with a "
                        "key the server was started with (--api-key, MLC_API_KEY or --api-key-file)")
        await mlc_error_response(err)(scope, receive, send)
