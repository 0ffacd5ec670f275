"""`mlc-cli train ... --ui`: a small web server beside the training loop that shows the run's live loss curve, lr,
grad norm, skipped steps, tokens/s, ETA and checkpoints (the same page as `mlc-cli serve`'s /train), and can
compare the run with another run directory.

It listens on 127.0.0.1 only (training logs and paths are not for the network; tunnel the port to look from
elsewhere) in a daemon thread, so it costs the training loop nothing but a file read every two seconds while a
page is open. After a run that finished, on an interactive terminal, it stays up until Ctrl+C.
"""

from __future__ import annotations

import atexit
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import mlc
from mlc.errors import ConfigError, MlcError

if TYPE_CHECKING:
    import uvicorn
from mlc.train.run_view import SUMMARY_FILE, read_run

DEFAULT_PORT = 8090
HOST = "127.0.0.1"
STATIC_DIR = Path(mlc.__file__).parent / "server" / "static"  # the server's page files, read as files
STATIC_FILES = ("common.css", "common.js", "charts.js", "train.js")
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


def _error(message: str, param: str | None) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}


def build_app(run_dir: str):
    """The UI's routes: the training page, its files, and the run's JSON (any run directory, to compare)."""
    from urllib.parse import quote

    from fastapi import FastAPI, Query, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import FileResponse, JSONResponse, RedirectResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="mlc training UI", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(MlcError)
    async def _mlc_error(_: Request, err: MlcError):
        body = {"error": {"message": err.message, "type": err.error_type, "param": err.field, "code": None}}
        return JSONResponse(body, err.http_status)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, err: HTTPException):
        message = str(err.detail)
        if err.status_code == 404:
            message = f"no route {request.url.path}; the training UI is at /train"
        return JSONResponse(_error(message, None), err.status_code)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, err: RequestValidationError):
        return JSONResponse(_error("give the run directory as ?dir=PATH", "dir"), 400)

    @app.get("/")
    async def root():
        return RedirectResponse("/train?run=" + quote(run_dir, safe=""))

    @app.get("/train")
    async def page():
        return FileResponse(STATIC_DIR / "train.html", media_type="text/html", headers=PAGE_HEADERS)

    @app.get("/static/{name}")
    async def static(name: str):
        if name not in STATIC_FILES:
            raise HTTPException(404)
        return FileResponse(STATIC_DIR / name, headers={"Cache-Control": "no-cache"})

    @app.get("/api/train/ui")
    async def ui_info():
        return {"run": run_dir}

    @app.get("/api/train/run")
    def run(dir: str = Query(..., max_length=4096)):
        return read_run(dir)

    return app


class TrainUI:
    def __init__(self, run_dir: str, port: int = DEFAULT_PORT, host: str = HOST):
        self.run_dir = str(Path(run_dir).expanduser().resolve())
        self.host = host
        self.sock = _bind(host, port)
        self.port = self.sock.getsockname()[1]
        self.started = time.time()
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/train"

    def start(self) -> TrainUI:
        import uvicorn

        config = uvicorn.Config(build_app(self.run_dir), log_level="warning", access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="mlc-train-ui",
                                       daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=5)
        self.sock.close()

    def finished(self) -> bool:
        """The run this process trained finished (it wrote its summary after the UI started)."""
        summary = Path(self.run_dir) / SUMMARY_FILE
        return summary.is_file() and summary.stat().st_mtime >= self.started

    def hold(self, console) -> None:
        """At exit: keep the page up after a finished run on an interactive terminal, until Ctrl+C."""
        try:
            if self.finished() and sys.stdin.isatty() and sys.stdout.isatty():
                console.print(f"training UI still at {self.url} (Ctrl+C to stop)", highlight=False)
                while self.thread is not None and self.thread.is_alive():
                    time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"--ui cannot listen on {host}:{port} ({e.strerror}); pass another --ui-port, or 0 for any "
                          "free port") from None
    sock.listen(64)
    sock.set_inheritable(False)
    return sock


def start_ui(run_dir: str, port: int = DEFAULT_PORT) -> TrainUI:
    """Serve the training page for `run_dir` in the background; prints its address, stops at process exit."""
    from rich.console import Console

    console = Console(stderr=True)
    ui = TrainUI(run_dir, port).start()
    console.print(f"training UI: [bold]{ui.url}[/]", highlight=False)
    atexit.register(ui.hold, console)
    return ui
