"""What the routes answer besides their 200 body, for /openapi.json."""

from __future__ import annotations

from pydantic import BaseModel

from mlc.server.input_policy import STRIPPED_HEADER
from mlc.server.protocol.schemas import ErrorResponse

REF = "#/components/schemas/{model}"

AUTH_RESPONSES: dict[int | str, dict] = {
    401: {"model": ErrorResponse, "description": "Missing or wrong `Authorization: Bearer` key; only when the server "
                                                 "runs with API keys (--api-key or MLC_API_KEY)."},
}
ERROR_RESPONSES: dict[int | str, dict] = {
    400: {"model": ErrorResponse, "description": "Invalid request, a body that is not JSON (`Content-Type: "
                                                 "application/json`), or a cross-field rule broken; `error.param` "
                                                 "names the field."},
    **AUTH_RESPONSES,
    404: {"model": ErrorResponse, "description": "Another model than the served one was asked for."},
    413: {"model": ErrorResponse, "description": "The request body is larger than the server's limit."},
    429: {"model": ErrorResponse, "description": "Queue full (--max-queue); see the Retry-After header."},
    503: {"model": ErrorResponse, "description": "The model is loading, or the server is shutting down."},
    504: {"model": ErrorResponse, "description": "No token within --request-timeout."},
}

GENERATION_HEADERS = {
    "x-request-id": {"description": "The request's id (also in the audit log).", "schema": {"type": "string"}},
    STRIPPED_HEADER: {"description": "Invisible characters removed from the prompt.", "schema": {"type": "integer"}},
}


def sse_response_doc(event: type[BaseModel]) -> dict[int | str, dict]:
    """The 200 of a route that streams with `stream: true`; the stream's schema describes one event (OpenAPI 3.1)."""
    data = {"type": "string", "if": {"const": "[DONE]"}, "else": {
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [{"$ref": REF.format(model=m.__name__)} for m in (event, ErrorResponse)]}}}
    return {200: {
        "description": f"JSON, or with `stream: true` server-sent events: `data: <{event.__name__} JSON>` lines (an "
                       "error body if the engine fails mid-stream), then `data: [DONE]`.",
        "headers": GENERATION_HEADERS,
        "content": {"text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                                     "properties": {"data": data}}}},
    }}


def add_event_schemas(components: dict, models: list[type[BaseModel]]) -> None:
    """Stream event models are no route's response_model: put them (and what they use) in the components."""
    for model in models:
        schema = model.model_json_schema(ref_template=REF, mode="serialization")
        for name, sub in {**schema.pop("$defs", {}), model.__name__: schema}.items():
            components.setdefault(name, sub)
