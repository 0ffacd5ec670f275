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

from starlette.types import ASGIApp, Receive, Scope, Send

from mlc.errors import AuthError
from mlc.server.errors import mlc_error_response
from mlc.server.keys import KeyRing, Match
from mlc.server.observability.audit import audit_info

log = logging.getLogger("mlc.server")

OPEN_PATHS = frozenset({"/health", "/ready", "/live", "/", "/favicon.ico", "/dashboard", "/train"})  # pages: no data
OPEN_PREFIXES = ("/static/",)
ENV_VAR = "MLC_API_KEY"
ADMIN_ENV_VAR = "MLC_ADMIN_API_KEY"
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})  # change what the server serves
# who the request's key is, for admission (per-key limits, fairness): set here, read by run_request.start
current_key: ContextVar[Match | None] = ContextVar("mlc_current_key", default=None)



def keys_from_env(value: str | None = None, var: str = ENV_VAR) -> list[str]:
    """MLC_API_KEY (or MLC_ADMIN_API_KEY) holds one key or several, comma-separated."""
    raw = os.environ.get(var, "") if value is None else value
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
    """`keys` (plain and named) guard every route but the open ones; the admin routes (`ADMIN_PATHS`: loading
    adapters) take only `admin_keys`, and are closed to everyone when `keys` are set and `admin_keys` are not."""

    def __init__(self, app: ASGIApp, keys: KeyRing, admin_keys: list[str] | None = None):
        self.app = app
        self.keys = keys
        self.admin_keys = list(admin_keys or [])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        admin = scope["type"] == "http" and scope["path"] in ADMIN_PATHS
        guarded = self.keys.enabled or (admin and bool(self.admin_keys))
        if scope["type"] != "http" or not guarded or is_open(scope["path"]) or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get("authorization")
        token = _token(given) or headers.get("x-api-key")  # Anthropic's clients send the key as x-api-key
        if admin:
            if token is not None and any([hmac.compare_digest(token.encode(), k.encode()) for k in self.admin_keys]):
                await self.app(scope, receive, send)
                return
            why = ("this route needs an admin key and the server has none (start it with --admin-api-key)"
                   if not self.admin_keys else
                   f"{check_authorization(given, []) if not token else 'the key is not an admin key'} "
                   "(this route takes an --admin-api-key key)")
            await self._refuse(scope, receive, send, why)
            return
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
        problem = check_authorization(given, []) if not token else None
        await self._refuse(scope, receive, send, problem or "the key is not one of the server's keys")

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, problem: str) -> None:
        client = scope.get("client") or ("?", 0)
        log.warning("401 %s %s from %s: %s", scope["method"], scope["path"], client[0], problem)
        err = AuthError(f"unauthorized: {problem}; send 'Authorization: Bearer <key>' (or 'x-api-key: <key>') with a "
                        "key the server was started with (--api-key, MLC_API_KEY or --api-key-file)")
        await mlc_error_response(err)(scope, receive, send)
