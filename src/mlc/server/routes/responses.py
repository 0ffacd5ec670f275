"""OpenAI's Responses API: POST /v1/responses (whole or streamed), GET and DELETE /v1/responses/{id}, and
POST /v1/responses/input_tokens. A request is translated into a chat completion request
(`protocol/responses_input.py`) and runs the chat path (`chat_run.start_chat`); its reply comes back as output
items (`responses_format.py`). Stored responses live in this process's memory (`response_store.py`)."""

from __future__ import annotations

import copy
from typing import Any, Literal

from fastapi import APIRouter, Query, Request, Security
from fastapi.responses import JSONResponse

from mlc.errors import InvalidRequestError
from mlc.server import run_request as rr
from mlc.server.bearer import bearer_scheme
from mlc.server.lenient import LenientRoute
from mlc.server.protocol.responses import (
    CreateResponseRequest,
    DeletedResponse,
    InputItemList,
    InputTokensResponse,
    ResponseObject,
    ResponsesInput,
    ResponseStreamEvent,
)
from mlc.server.protocol.responses_doc import ERROR_RESPONSES, sse_response_doc
from mlc.server.protocol.responses_input import chat_fields, input_items, input_messages
from mlc.server.protocol.schemas import ErrorResponse
from mlc.server.protocol.streaming import sse_event
from mlc.server.response_store import ResponseStore
from mlc.server.routes.chat_run import as_chat, plan_only, run_reply, start_chat
from mlc.server.routes.responses_format import (
    ResponsesStream,
    assistant_message,
    output_items,
    request_echo,
    response_object,
    usage,
)

NOT_STORED: dict[int | str, dict[str, Any]] = {404: {"model": ErrorResponse, "description": (
    "No stored response with this id: never stored (store: false), deleted, or evicted (in memory, bounded).")}}
router = APIRouter(tags=["Responses"], dependencies=[Security(bearer_scheme)], responses=ERROR_RESPONSES,
                   route_class=LenientRoute)


def store_of(request: Request) -> ResponseStore:
    app_state = request.app.state
    if getattr(app_state, "responses", None) is None:
        app_state.responses = ResponseStore()
    return app_state.responses


def _history(body: ResponsesInput, store: ResponseStore) -> list[dict]:
    if body.previous_response_id is None:
        return []
    return copy.deepcopy(store.get(body.previous_response_id, "previous_response_id").history)


@router.post("/v1/responses", response_model=ResponseObject, responses=sse_response_doc(ResponseStreamEvent),
             summary="Create a model response (OpenAI's Responses API)")
async def create_response(body: CreateResponseRequest, request: Request):
    """Text or message input, instructions, function tools and their outputs, text.format (json_schema /
    json_object by constrained decoding), reasoning items from GLM thinking, previous_response_id over stored
    responses. Streams `event: <type>` / `data: <event>` pairs and no [DONE]. Refused with a 400 naming the field:
    hosted tools, non-text content, background, conversation, prompt, top_logprobs."""
    store = store_of(request)
    history = _history(body, store)
    chat = as_chat(chat_fields(body, history))
    run = await start_chat(chat, request, "resp", "max_output_tokens")
    echo, created = request_echo(body), run.state.created_now()
    conversation = history + input_messages(body.input)

    def keep(response: dict, reply) -> None:
        if body.store is not False:
            store.put(response, conversation + [assistant_message(reply)], input_items(body.input))

    if body.stream:
        fmt = ResponsesStream(run.rid, created, run.model, echo, run.plan.output(), keep)
        return await rr.stream(request, run.gen, fmt.chunks, fmt.final, run.headers, opening=fmt.start(),
                               frame=sse_event, end="", failed=lambda e: fmt.failed(e.message, e.error_type, e.field))
    ran = await run_reply(request, run)
    if not isinstance(ran, tuple):
        return ran
    out, o, reply = ran
    response = response_object(run.rid, created, run.model, echo, output_items(reply), o.finish_reason,
                               usage(len(out.prompt_token_ids), out.num_generated_tokens))
    keep(response, reply)
    return JSONResponse(response, headers=run.headers)


@router.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=NOT_STORED,
            summary="A stored response")
async def get_response(response_id: str, request: Request):
    return JSONResponse(store_of(request).get(response_id).response)


@router.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=NOT_STORED,
               summary="Delete a stored response")
async def delete_response(response_id: str, request: Request):
    store_of(request).delete(response_id)
    return DeletedResponse(id=response_id)


@router.get("/v1/responses/{response_id}/input_items", response_model=InputItemList, responses=NOT_STORED,
            summary="The input items of a stored response")
async def list_input_items(response_id: str, request: Request, limit: int = Query(20, ge=1, le=100),
                           order: Literal["asc", "desc"] = "desc", after: str | None = None):
    items = store_of(request).get(response_id).input_items
    items = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in items]
    if after is not None:
        if after not in ids:
            raise InvalidRequestError(f"after {after!r} is not an item of this response", field="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return InputItemList(data=page, has_more=len(items) > limit, first_id=page[0]["id"] if page else None,
                         last_id=page[-1]["id"] if page else None)


@router.post("/v1/responses/input_tokens", response_model=InputTokensResponse,
             summary="Count the input tokens a response would take")
async def input_tokens(body: ResponsesInput, request: Request):
    """The prompt's tokens as the chat template renders it: instructions, the stored conversation of
    previous_response_id, the input and the tools."""
    chat = as_chat(chat_fields(body, _history(body, store_of(request))))
    plan = await plan_only(chat, request)
    return InputTokensResponse(input_tokens=len(plan.prompt.ids))
