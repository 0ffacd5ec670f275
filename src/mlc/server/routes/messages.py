"""Anthropic's Messages API: POST /v1/messages (whole or streamed) and POST /v1/messages/count_tokens. A request
is translated into a chat completion request (`protocol/anthropic.py`) and runs the chat path
(`chat_run.start_chat`); its reply comes back as content blocks (`messages_format.py`). Errors on these routes
take Anthropic's shape (`AnthropicErrors`), and `x-api-key` is accepted as well as a bearer key (`auth.py`)."""

from __future__ import annotations

import json
import logging

from fastapi import APIRouter, Request, Security
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlc.server import run_request as rr
from mlc.server.bearer import bearer_scheme
from mlc.server.lenient import LenientRoute
from mlc.server.protocol.anthropic import (
    AnthropicError,
    CountTokensRequest,
    CountTokensResponse,
    MessageObject,
    MessagesRequest,
    MessageStreamEvent,
    chat_fields,
)
from mlc.server.protocol.responses_doc import ERROR_RESPONSES, sse_response_doc
from mlc.server.protocol.streaming import sse_event
from mlc.server.routes.chat_run import ChatRun, as_chat, plan_only, run_reply, start_chat
from mlc.server.routes.messages_format import (
    MessagesStream,
    content_blocks,
    error_type,
    message_object,
    stop_reason,
    usage,
)
from mlc.server.state import loaded_engine

log = logging.getLogger("mlc.server")
PREFIX = "/v1/messages"
ANTHROPIC_ERRORS = {status: {"model": AnthropicError, "description": doc["description"].replace(
    "`error.param` names", "`error.message` starts with")} for status, doc in ERROR_RESPONSES.items()}

router = APIRouter(tags=["Anthropic Messages"], dependencies=[Security(bearer_scheme)], responses=ANTHROPIC_ERRORS,
                   route_class=LenientRoute)


def stop_matcher(run: ChatRun, stops: list[str] | None):
    """Which stop sequence ended an output: the engine cuts it from the text, so it starts the rest of the
    decoded tokens."""
    def matched(o) -> str | None:
        if not stops or o.finish_reason != "stop":
            return None
        rest = loaded_engine(run.state).decode(o.token_ids, skip_special_tokens=False)[len(o.text):]
        return next((s for s in stops if rest.startswith(s)), next((s for s in stops if s in rest), None))
    return matched


@router.post(PREFIX, response_model=MessageObject, responses=sse_response_doc(MessageStreamEvent),
             summary="Create a message (Anthropic's Messages API)")
async def create_message(body: MessagesRequest, request: Request):
    """System prompt (string or text blocks), text / tool_use / tool_result / thinking blocks, client tools,
    tool_choice, stop_sequences, thinking from GLM reasoning. Streams `event: <type>` / `data: <event>` pairs.
    Refused with a 400 naming the field: image and document blocks, server tools, mcp_servers, container."""
    chat = as_chat(chat_fields(body))
    run = await start_chat(chat, request, "msg", "max_tokens")
    matched = stop_matcher(run, body.stop_sequences)
    if body.stream:
        fmt = MessagesStream(run.rid, run.model, run.plan.output(), matched)
        opening = fmt.start(len(run.gen.prompt_ids))
        return await rr.stream(request, run.gen, fmt.chunks, fmt.final, run.headers, opening=opening,
                               frame=sse_event, end="", failed=lambda e: fmt.failed(e.http_status, e.message))
    ran = await run_reply(request, run)
    if not isinstance(ran, tuple):
        return ran
    out, o, reply = ran
    stop = matched(o)
    message = message_object(run.rid, run.model, content_blocks(reply), stop_reason(o.finish_reason,
                             bool(reply.calls), stop), stop, usage(len(out.prompt_token_ids), len(o.token_ids)))
    return JSONResponse(message, headers=run.headers)


@router.post(PREFIX + "/count_tokens", response_model=CountTokensResponse, summary="Count a message's input tokens")
async def count_tokens(body: CountTokensRequest, request: Request):
    """The prompt's tokens as the chat template renders the system prompt, messages and tools."""
    plan = await plan_only(as_chat(chat_fields(body)), request)
    return CountTokensResponse(input_tokens=len(plan.prompt.ids))


class AnthropicErrors:
    """Errors under /v1/messages in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, whoever
    answered them (the route, validation, auth, the body limit); other routes keep OpenAI's."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        started = False
        chunks: list[bytes] = []

        async def reshape(message: Message) -> None:
            nonlocal start, started
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None:
                started = True
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                await self._send_error(start, b"".join(chunks), send)

        try:
            await self.app(scope, receive, reshape)
        except Exception:  # Starlette answers these outside every middleware: answer here, in this API's shape
            if started or start is not None:
                raise
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            raw = json.dumps({"error": {"message": "internal server error; see the server log"}}).encode()
            await self._send_error({"status": 500}, raw, send)

    @staticmethod
    async def _send_error(start: Message, raw: bytes, send: Send) -> None:
        try:
            detail = json.loads(raw)["error"]
            text = detail["message"] if detail.get("param") is None or detail["param"] in detail["message"] else \
                f"{detail['param']}: {detail['message']}"
        except (ValueError, KeyError, TypeError):
            text = raw.decode("utf-8", "replace") or "error"
        status = start["status"]
        body = json.dumps({"type": "error", "error": {"type": error_type(status), "message": text}}).encode()
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length", b"content-type")]
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

