"""/health (the reference tutorial's contract: 503 {"status": "loading"} until the model is ready, then 200
{"status": "healthy"}), /ready and /live for orchestrators. None of them needs a key."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from mlc.server.protocol.schemas_tokenize import HealthResponse
from mlc.server.run_request import get_state
from mlc.server.state import DRAINING, ERROR, HEALTHY, LOADING

router = APIRouter(tags=["health"])

NOT_READY: dict[int | str, dict[str, Any]] = {
    503: {"model": HealthResponse, "description": "loading, draining (shutting down) or error"}}


def _answer(status: str, ok: str, message: str | None = None) -> JSONResponse:
    body = HealthResponse(status=ok if status == HEALTHY else status, message=message)
    return JSONResponse(body.model_dump(exclude_none=True), 200 if status == HEALTHY else 503)


@router.get("/health", response_model=HealthResponse, responses=NOT_READY, summary="200 once the model serves")
async def health(request: Request):
    state = get_state(request)
    status = state.status
    if status == HEALTHY and state.engine is not None and state.engine.error is not None:
        status = ERROR
    return _answer(status, "healthy", state.error if status == ERROR else None)


@router.get("/ready", response_model=HealthResponse, responses=NOT_READY, summary="Readiness: same as /health")
async def ready(request: Request):
    state = get_state(request)
    return _answer(state.status, "ready", state.error if state.status == ERROR else None)


@router.get("/live", response_model=HealthResponse, responses=NOT_READY,
            summary="Liveness: 200 while the process works, loading included")
async def live(request: Request):
    state = get_state(request)
    engine_error = state.engine.error if state.engine is not None else None
    if state.status == ERROR or engine_error is not None:
        return _answer(ERROR, "alive", state.error or str(engine_error))
    return _answer(HEALTHY, "alive") if state.status in (LOADING, HEALTHY, DRAINING) else _answer(ERROR, "alive")
