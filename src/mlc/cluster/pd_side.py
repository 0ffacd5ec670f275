"""A deployed prefill replica's side channel: the connector's two routes (`POST /v1/kv/pull`, `POST /v1/kv/release`,
`server/pd.py`) served on the replica's node, since a replica has no HTTP listener of its own (the gateway drives its
app in-process). Decode replicas reach it at the address the prefill puts in its KV handle.

It listens on the replica's node address only, and answers only requests that carry the token the deployment gave
its replicas (`x-mlc-kv-token`): a client of the endpoint never sees this port or the token.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
from typing import Any

log = logging.getLogger("mlc.cluster.pd")


class SideChannel:
    def __init__(self, state: Any, host: str, token: str) -> None:
        self.state, self.host, self.token = state, host, token
        self.url = ""
        self._server: Any = None
        self._task: asyncio.Task | None = None

    async def start(self) -> str:
        import uvicorn
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse

        from mlc.server.errors import error_body
        from mlc.server.pd import TOKEN_HEADER, router

        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
        app.state.mlc = self.state
        app.include_router(router)

        @app.middleware("http")
        async def check_token(request: Request, call_next):
            given = request.headers.get(TOKEN_HEADER, "").encode("latin-1", "replace")
            if not hmac.compare_digest(given, self.token.encode()):
                return JSONResponse(error_body("not a replica of this deployment", "authentication_error", None,
                                               "kv_token"), 403)
            return await call_next(request)

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.create_server((self.host, 0), family=family)
        shown = f"[{self.host}]" if family == socket.AF_INET6 else self.host
        self.url = f"http://{shown}:{sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.05)
        if self._task.done():
            sock.close()
            raise RuntimeError(f"the KV side channel did not start on {self.host}: {self._task.exception()}")
        log.info("KV side channel on %s", self.url)
        return self.url

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=5)
