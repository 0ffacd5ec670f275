"""What the routes answer besides their 200 body, for /openapi.json."""

from __future__ import annotations

from mlc.server.input_policy import STRIPPED_HEADER
from mlc.server.schemas import ErrorResponse

ERROR_RESPONSES: dict[int | str, dict] = {
    400: {"model": ErrorResponse, "description": "Invalid request; `error.param` names the field."},
    401: {"model": ErrorResponse, "description": "Missing or wrong `Authorization: Bearer` key."},
    404: {"model": ErrorResponse, "description": "Another model than the served one was asked for."},
    429: {"model": ErrorResponse, "description": "Queue full (--max-queue); see the Retry-After header."},
    503: {"model": ErrorResponse, "description": "The model is loading, or the server is shutting down."},
    504: {"model": ErrorResponse, "description": "No token within --request-timeout."},
}

GENERATION_HEADERS = {
    "x-request-id": {"description": "The request's id (also in the audit log).", "schema": {"type": "string"}},
    STRIPPED_HEADER: {"description": "Invisible characters removed from the prompt.", "schema": {"type": "integer"}},
}


def sse_response_doc(event: str) -> dict[int | str, dict]:
    return {200: {
        "description": f"JSON, or with `stream: true` server-sent events: `data: <{event}>` lines, then "
                       "`data: [DONE]`.",
        "headers": GENERATION_HEADERS,
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }}
