"""The FastAPI app: routes by API, one error mapping, auth and audit middlewares, the model loaded in the background."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse

from mlc import __version__
from mlc.config.serve_config import ServeConfig
from mlc.server import health, metrics, native, openai_api, tokenize
from mlc.server.audit import AuditMiddleware
from mlc.server.auth import APIKeyMiddleware
from mlc.server.errors import install_error_handlers
from mlc.server.hooks import HooksConfig
from mlc.server.state import ServerState, default_engine_factory

STATIC_DIR = Path(__file__).parent / "static"
MAX_BODY_BYTES = 32 * 2**20

DESCRIPTION = """\
The native API (`/generate`, as in the reference tutorial), the OpenAI-compatible API (`/v1/...`), tokenizer
routes and Prometheus `/metrics`. With API keys configured every route except `/health`, `/ready`, `/live` and the
chat page at `/` needs `Authorization: Bearer <key>`. Errors are `{"error": {"message", "type", "param", "code"}}`.
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

    app = FastAPI(title="mlc", version=__version__, description=DESCRIPTION, lifespan=lifespan,
                  max_body_size=MAX_BODY_BYTES)
    app.state.mlc = state
    install_error_handlers(app)
    for module in (health, native, openai_api, tokenize, metrics):
        app.include_router(module.router)

    @app.get("/", response_class=FileResponse, tags=["web"], summary="The built-in chat page",
             responses={200: {"content": {"text/html": {}}}})
    async def chat_page():
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    _drop_422(app)
    if config.api_keys:
        app.add_middleware(APIKeyMiddleware, keys=config.api_keys)
    if state.audit_log is not None or state.hooks.enabled:
        app.add_middleware(AuditMiddleware, audit_log=state.audit_log, hooks=state.hooks, model=state.model_id)
    return app


def _drop_422(app: FastAPI) -> None:
    """FastAPI documents a 422 on every route with a body; this server answers validation errors with 400."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            for operations in schema["paths"].values():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
        return app.openapi_schema

    app.openapi = openapi
