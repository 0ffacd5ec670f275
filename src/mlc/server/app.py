"""The FastAPI app: routes by API, one error mapping, auth and audit middlewares, the model loaded in the background."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlc import __version__
from mlc.config.serve_config import ServeConfig
from mlc.server.auth import APIKeyMiddleware
from mlc.server.errors import error_body, install_error_handlers
from mlc.server.observability import metrics
from mlc.server.observability.audit import AuditMiddleware
from mlc.server.observability.hooks import HooksConfig
from mlc.server.pd import PDMiddleware, attach_pd
from mlc.server.pd import router as kv_router
from mlc.server.protocol.anthropic import MessageStreamEvent
from mlc.server.protocol.responses import ResponseStreamEvent
from mlc.server.protocol.responses_doc import add_event_schemas
from mlc.server.protocol.schemas import ChatCompletionChunk, GenerateEvent
from mlc.server.routes import health, lora, messages, native, openai_api, pages, responses, tokenize
from mlc.server.state import ServerState, default_engine_factory

MAX_BODY_BYTES = 32 * 2**20

DESCRIPTION = """\
The native API (`/generate`, as in the reference tutorial), the OpenAI-compatible API (`/v1/...`, with the
Responses API at `/v1/responses`), Anthropic's Messages API (`/v1/messages`), tokenizer routes and Prometheus
`/metrics`. With API keys configured every route except `/health`, `/ready`, `/live` and the chat page at `/` needs
`Authorization: Bearer <key>` (or `x-api-key: <key>`). Errors are `{"error": {"message", "type", "param", "code"}}`,
and `{"type": "error", "error": {"type", "message"}}` under `/v1/messages`.
"""


def create_app(config: ServeConfig, hooks: HooksConfig | None = None,
               engine_factory: Callable[[ServeConfig], Any] = default_engine_factory) -> FastAPI:
    state = ServerState(config, hooks, engine_factory)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            state.close()

    app = FastAPI(title="mlc", version=__version__, description=DESCRIPTION, lifespan=lifespan)
    app.state.mlc = state
    install_error_handlers(app)
    # pages: /, /dashboard, /train, /api/*
    for module in (health, native, openai_api, lora, responses, messages, tokenize, metrics, pages):
        app.include_router(module.router)
    app.include_router(kv_router)

    _finish_openapi(app)
    state.on_ready.append(lambda engine: attach_pd(state, engine))
    app.add_middleware(PDMiddleware, role=config.kv_role)  # innermost: the transfer headers, per request
    app.add_middleware(BodyLimitMiddleware, limit=MAX_BODY_BYTES)  # auth and audit see the 413 first
    if state.keys.enabled or config.admin_api_keys:
        app.add_middleware(APIKeyMiddleware, keys=state.keys, admin_keys=config.admin_api_keys)
    if state.audit_log is not None or state.hooks.enabled:
        app.add_middleware(AuditMiddleware, audit_log=state.audit_log, hooks=state.hooks, model=state.model_id)
    app.add_middleware(metrics.RouteCounter, metrics=state.metrics)  # auth's 401s come before routing: unmatched
    app.add_middleware(messages.AnthropicErrors)  # outermost: reshapes every error under /v1/messages
    return app


def body_limit_message(limit: int) -> str:
    return (f"the request body is larger than this server's limit of {limit // 2**20} MiB; send less "
            "(fewer or shorter prompts)")


class BodyLimitMiddleware:
    """A body over `limit` bytes gets a JSON 413 before any of it is parsed: at once when Content-Length says so,
    else as soon as the bytes received pass the limit (Starlette's own limit answers in plain text)."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit
        self.message = body_limit_message(limit)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.limit:
            body = error_body(self.message, "invalid_request_error", "body", "body_too_large")
            await JSONResponse(body, 413, headers={"Connection": "close"})(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise HTTPException(413, self.message)  # inside the route: the error handlers answer it
            return message

        await self.app(scope, counted, send)


def _finish_openapi(app: FastAPI) -> None:
    """FastAPI documents a 422 on every route with a body, where this server answers 400; and it knows nothing of
    the stream events' models."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        schema = app.openapi_schema
        if schema is None:
            schema = build()  # FastAPI's: keeps the schema it returns in app.openapi_schema
            for operations in schema["paths"].values():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            add_event_schemas(schema["components"]["schemas"],
                              [GenerateEvent, ChatCompletionChunk, ResponseStreamEvent, MessageStreamEvent])
        return schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customize the schema
