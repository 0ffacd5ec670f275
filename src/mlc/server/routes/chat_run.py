"""A chat completion request run for another API (Responses, Anthropic Messages): the chat route's own checks,
plan (template, tools, reasoning, grammar), params and admission, so every API shares one engine path, one tool-call
parser and one reasoning parser. The caller translated its body into a `ChatCompletionRequest` and translates the
reply back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from mlc.errors import InvalidRequestError
from mlc.server import run_request as rr
from mlc.server.chat.assistant_output import Reply
from mlc.server.chat.request import ChatPlan, plan_chat
from mlc.server.errors import describe_validation_error
from mlc.server.generation import Generation
from mlc.server.prompting import off_loop
from mlc.server.protocol.schemas import ChatCompletionRequest
from mlc.server.routes.openai_api import _begin, _chat_checks, _limits, _params
from mlc.server.state import ServerState

if TYPE_CHECKING:
    from mlc.engine.outputs import CompletionOutput, RequestOutput


@dataclass
class ChatRun:
    state: ServerState
    rid: str
    model: str
    plan: ChatPlan
    gen: Generation
    headers: dict[str, str]


def as_chat(fields: dict) -> ChatCompletionRequest:
    """The translated body as the chat route's request; what the chat schema refuses is a 400 naming the chat
    field (the translation checked the other API's own fields first)."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
        message, param, _ = describe_validation_error(errors)
        raise InvalidRequestError(f"{message} (in the request as chat completions reads it)", field=param) from None


async def plan_only(body: ChatCompletionRequest, request: Request) -> ChatPlan:
    """The prompt the chat path would run (for token counts), without running it."""
    state, _, _, _ = await _begin(body, request)
    return await off_loop(plan_chat, state, body, _limits(state, body).context)


async def start_chat(body: ChatCompletionRequest, request: Request, id_prefix: str,
                     max_field: str) -> ChatRun:
    """Admit and start `body` as /v1/chat/completions would; errors name `max_field` for the token bound."""
    state, info, adapter_id, model_name = await _begin(body, request)
    max_tokens, _ = _chat_checks(body, info)
    limits = _limits(state, body)
    plan = await off_loop(plan_chat, state, body, limits.context)
    rename = {"max_new_tokens": max_field, "min_new_tokens": "min_tokens"}
    params = _params(state, body, plan.prompt, limits, max_tokens, None, rename, plan.grammar)
    rid = state.new_request_id(id_prefix)
    info.request_id, info.prompt_tokens, info.stripped_chars = rid, len(plan.prompt.ids), plan.prompt.stripped
    if state.config.audit_log_content:
        info.prompt = [m.model_dump(exclude_none=True) for m in body.messages]
    (gen,) = await rr.start(state, rid, [(plan.prompt.ids, params)], adapter_id)
    return ChatRun(state, rid, model_name, plan, gen, rr.headers_for(rid, plan.prompt.stripped))


async def run_reply(request: Request, run: ChatRun) -> tuple[RequestOutput, CompletionOutput, Reply] | Response:
    """Run to the end and read the reply as the chat route reads it; a Response (499) if the client left."""
    outs = await rr.run_to_end(request, [run.gen])
    if not isinstance(outs, list):
        return outs
    (out,) = outs
    (o,) = out.outputs
    return out, o, run.plan.output().reply(o.text)
