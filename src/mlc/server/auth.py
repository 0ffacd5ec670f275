"""Bearer-token auth: with keys configured, every route but the open ones needs `Authorization: Bearer <key>`, or
`x-api-key: <key>` as Anthropic's clients send it.

Checked in an ASGI middleware, before the body is read, so an unauthenticated client learns nothing about the API
beyond 401. Failures are logged with the client address and the reason, never with the key that was sent.
"""

from __future__ import annotations

import hmac
import logging
import os

from fastapi.security import HTTPBearer
from starlette.types import ASGIApp, Receive, Scope, Send

from mlc.errors import AuthError
from mlc.server.errors import mlc_error_response

log = logging.getLogger("mlc.server")

OPEN_PATHS = frozenset({"/health", "/ready", "/live", "/", "/favicon.ico", "/dashboard", "/train"})  # pages: no data
OPEN_PREFIXES = ("/static/",)
ENV_VAR = "MLC_API_KEY"
ADMIN_ENV_VAR = "MLC_ADMIN_API_KEY"
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})  # change what the server serves

# Documents the scheme in /openapi.json; the middleware does the checking.
bearer_scheme = HTTPBearer(auto_error=False, description="Needed when the server runs with --api-key / MLC_API_KEY.")


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


class APIKeyMiddleware:
    """`keys` guard every route but the open ones; the admin routes (`ADMIN_PATHS`: loading adapters) take only
    `admin_keys`, and are closed to everyone when `keys` are set and `admin_keys` are not."""

    def __init__(self, app: ASGIApp, keys: list[str], admin_keys: list[str] | None = None):
        self.app = app
        self.keys = list(keys)
        self.admin_keys = list(admin_keys or [])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        admin = scope["type"] == "http" and scope["path"] in ADMIN_PATHS
        keys = (self.admin_keys or self.keys) if admin else self.keys
        if scope["type"] != "http" or not keys or is_open(scope["path"]) or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get("authorization")
        problem = check_authorization(given, keys)
        if problem is not None and headers.get("x-api-key"):  # Anthropic's clients send the key this way
            problem = check_authorization(f"Bearer {headers['x-api-key']}", keys)
        if admin and not self.admin_keys:
            problem = "this route needs an admin key and the server has none (start it with --admin-api-key)"
        elif admin and problem is not None:
            problem = f"{problem} (this route takes an --admin-api-key key)"
        if problem is None:
            await self.app(scope, receive, send)
            return
        client = scope.get("client") or ("?", 0)
        log.warning("401 %s %s from %s: %s", scope["method"], scope["path"], client[0], problem)
        err = AuthError(f"unauthorized: {problem}; send 'Authorization: Bearer <key>' (or 'x-api-key: <key>') with a "
                        "key the server was started with (--api-key or MLC_API_KEY)")
        await mlc_error_response(err)(scope, receive, send)
