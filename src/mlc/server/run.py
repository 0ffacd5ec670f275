"""Run the app under uvicorn, with a graceful SIGTERM: stop admitting (503), let in-flight requests finish within
the grace period, cancel what is left (finish_reason "abort"), then exit 0. SIGHUP reloads --api-key-file.

A second SIGTERM/SIGINT cuts the grace period short: in-flight requests end at once with finish_reason "abort" (a
JSON body, or a stream's final chunk and [DONE]) and the process exits as soon as they are answered; only a third
signal exits without answering them."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading

import uvicorn

from mlc.config.serve_config import ServeConfig
from mlc.engine.sequence import FinishReason
from mlc.server.app import create_app
from mlc.server.connections import guarded_protocol
from mlc.server.observability.hooks import HooksConfig
from mlc.server.state import ServerState

log = logging.getLogger("mlc.server")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, grace_s: float):
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
        self._signals = 0

    def handle_exit(self, sig: int, frame) -> None:
        loop = self.state.loop
        if loop is None or self._signals >= 2:
            # before startup there is nothing to drain; a third signal stops without answering in-flight requests
            self.force_exit = self._signals >= 2
            self.should_exit = True
            return
        self._signals += 1
        log.info("received %s", signal.Signals(sig).name)
        if self._signals == 1:
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))
        else:
            loop.call_soon_threadsafe(self._abort_in_flight)

    def _abort_in_flight(self) -> None:
        """End every in-flight request now with finish_reason "abort"; the drain then sees none left and exits."""
        log.warning("second signal: aborting %d request(s) in flight", len(self.state.active))
        for g in list(self.state.active):
            g.stop(FinishReason.ABORT)

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
    protocol = guarded_protocol(config.header_timeout_s, config.body_timeout_s, state.metrics.count_closed)
    if protocol is None:
        log.warning("httptools is not installed: requests have no header or body deadline (pip install httptools)")
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level, access_log=access_log,
                        timeout_graceful_shutdown=5, lifespan="on", http=protocol or "auto",
                        limit_concurrency=config.max_connections,
                        timeout_keep_alive=config.keep_alive_timeout_s)  # type: ignore[arg-type]  # call_later's
    server = GracefulServer(uv, state, config.shutdown_grace_s)

    def fatal() -> None:
        server.should_exit = True

    state.on_fatal = fatal
    if state.keys.path and hasattr(signal, "SIGHUP") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGHUP, lambda *_: reload_keys(state))
    return server


def reload_keys(state: ServerState) -> None:
    """SIGHUP: re-read --api-key-file on the event loop (requests in flight keep running; a bad file keeps the old
    keys and logs why)."""
    log.info("received SIGHUP: reloading the API key file %s", state.keys.path)
    if state.loop is None:
        state.keys.reload()
    else:
        state.loop.call_soon_threadsafe(state.keys.reload)


def serve(config: ServeConfig, hooks: HooksConfig | None = None, **kw) -> int:
    """Serve until SIGTERM/SIGINT; the exit code is non-zero when the model could not be loaded."""
    server = build_server(config, hooks, **kw)
    server.run()
    return server.state.exit_code
