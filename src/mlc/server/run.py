"""Run the app under uvicorn, with a graceful SIGTERM: stop admitting (503), let in-flight requests finish within
the grace period, cancel what is left (finish_reason "abort"), then exit 0."""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

from mlc.config.serve_config import ServeConfig
from mlc.server.app import create_app
from mlc.server.hooks import HooksConfig
from mlc.server.state import ServerState

log = logging.getLogger("mlc.server")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float):
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
        self._draining = False

    def handle_exit(self, sig: int, frame) -> None:
        loop = self.state.loop
        if self._draining or loop is None:
            # a second signal (or one before startup): stop now, as uvicorn does
            self.force_exit = self._draining
            self.should_exit = True
            return
        self._draining = True
        log.info("received %s", signal.Signals(sig).name)
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        try:
            await self.state.drain(self.grace_s)
        finally:
            self.should_exit = True


def build_server(config: ServeConfig, hooks: HooksConfig | None = None, log_level: str = "info",
                 access_log: bool = True) -> GracefulServer:
    """The uvicorn server for `config` (raises ConfigError for an unusable audit log before anything listens)."""
    app = create_app(config, hooks)
    state: ServerState = app.state.mlc
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level, access_log=access_log,
                        timeout_graceful_shutdown=5, lifespan="on")
    server = GracefulServer(uv, state, config.shutdown_grace_s)

    def fatal() -> None:
        server.should_exit = True

    state.on_fatal = fatal
    return server


def serve(config: ServeConfig, hooks: HooksConfig | None = None, **kw) -> int:
    """Serve until SIGTERM/SIGINT; the exit code is non-zero when the model could not be loaded."""
    server = build_server(config, hooks, **kw)
    server.run()
    return server.state.exit_code
