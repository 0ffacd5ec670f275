"""The web UI's pages and the JSON they read: `/dashboard` (live server load), `/train` (a training run's curves),
their scripts under `/static/`, `GET /api/metrics` and `GET /api/train/run`.

The pages themselves hold no data and need no key; the JSON routes do when the server runs with API keys (the page
asks for the key and keeps it in the browser tab's sessionStorage). Pages get a strict Content-Security-Policy:
scripts only from this server, so text a model writes can never run as code.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query, Request, Security
from fastapi.responses import FileResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from mlc.server.bearer import bearer_scheme
from mlc.server.protocol.responses_doc import AUTH_RESPONSES
from mlc.server.protocol.schemas import ErrorResponse
from mlc.server.routes.dashboard import MetricsSnapshot, snapshot
from mlc.server.run_request import get_state

STATIC_DIR = Path(__file__).parents[1] / "static"  # mlc/server/static
STATIC_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*\.(?:js|css|html|svg|png|ico)$")
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
PAGE_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}

chat = APIRouter(tags=["web"])  # the chat page stays in /openapi.json, as it always was
pages = APIRouter(tags=["web"], include_in_schema=False)
api = APIRouter(tags=["web"], dependencies=[Security(bearer_scheme)])


def page(name: str) -> FileResponse:
    return FileResponse(STATIC_DIR / name, media_type="text/html", headers=PAGE_HEADERS)


@chat.get("/", response_class=FileResponse, summary="The built-in chat page",
          responses={200: {"content": {"text/html": {}}}})
async def chat_page():
    return page("index.html")


@pages.get("/dashboard")
async def dashboard_page():
    return page("dashboard.html")


@pages.get("/train")
async def train_page():
    return page("train.html")


@pages.get("/static/{name}")
async def static_file(name: str):
    path = STATIC_DIR / name
    if not STATIC_NAME.match(name) or not path.is_file():
        raise HTTPException(404)
    return FileResponse(path, headers={"X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"})


@api.get("/api/metrics", response_model=MetricsSnapshot, summary="Live load and latency as JSON (the dashboard)",
         responses=AUTH_RESPONSES)
async def metrics_json(request: Request, since: float | None = Query(
        None, description="Only history samples newer than this server time (the `time` of the previous answer).")):
    return snapshot(get_state(request), since)


class TrainStep(BaseModel):
    step: int
    loss: float | None = Field(description="None when not finite (a skipped step).")
    lr: float | None
    grad_norm: float | None
    tokens_per_s: float | None
    tokens: float | None
    epoch: float | None
    skipped: bool


class TrainEval(BaseModel):
    step: int
    eval_loss: float | None
    eval_ppl: float | None


class TrainCheckpoint(BaseModel):
    step: int
    path: str
    saved_at: float


class TrainLast(BaseModel):
    loss: float | None
    lr: float | None
    grad_norm: float | None
    tokens_per_s: float | None
    eval_loss: float | None


class TrainRun(BaseModel):
    dir: str
    name: str
    status: str = Field(description="running (its log changed in the last two minutes), finished or stopped")
    updated_at: float | None
    step: int = Field(description="The last logged step.")
    total_steps: int | None
    eta_s: float | None
    seconds_per_step: float | None
    skipped_total: int
    last: TrainLast
    steps: list[TrainStep]
    evals: list[TrainEval]
    checkpoints: list[TrainCheckpoint]
    config: dict[str, Any]
    summary: dict[str, Any] | None


@api.get("/api/train/run", response_model=TrainRun, summary="A training run's log, checkpoints and progress",
         responses={400: {"model": ErrorResponse, "description": "`dir` is not a training run directory."},
                    **AUTH_RESPONSES})
def train_run(run_dir: str = Query(..., alias="dir", max_length=4096,
                                   description="The run's output_dir, as on the server's disk.")):
    from mlc.train.run_view import read_run  # read on a worker thread: a long log is a few MB of JSON

    return read_run(run_dir)


router = APIRouter()
for part in (chat, pages, api):
    router.include_router(part)
