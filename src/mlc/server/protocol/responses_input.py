"""A Responses API request as a chat completion request: its input items as chat messages, its function tools,
tool_choice and text.format as the chat fields that mean the same. The route then runs the chat path as it is.

Everything here is a pure function of the request (and of the stored conversation that previous_response_id
names), so `tests/unit/test_api_translation.py` checks it without a server.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from mlc.errors import InvalidRequestError, UnsupportedFeatureError
from mlc.server.protocol.responses import CreateResponseRequest, ResponsesInput

TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
HOSTED = "only function tools run on this server; {kind!r} needs OpenAI's hosted service: remove it"


def part_text(content: Any, field: str) -> str:
    """A string, or text parts joined; other parts (images, files, audio) are refused: this model reads text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{field} must be a string or a list of text parts", field=field)
    texts = []
    for j, part in enumerate(content):
        where = f"{field}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            if kind is None:
                raise InvalidRequestError(f"{where} must be an object with a type, like "
                                          '{"type": "input_text", "text": "..."}', field=where)
            raise UnsupportedFeatureError(f"{where}: content of type {kind!r} is not supported; this model reads "
                                          "text only (input_text / output_text)", field=where)
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise InvalidRequestError(f"{where}.text must be a string", field=f"{where}.text")
        texts.append(text)
    return "".join(texts)


def _need(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{where}.{key} is missing; a {item.get('type')} item needs its {key} (a string)",
                                  field=f"{where}.{key}")
    return value


def _arguments(arguments: Any, where: str) -> str:
    """A function_call's arguments: a JSON object as a string, as the Responses API sends them."""
    try:
        ok = isinstance(json.loads(arguments or "{}"), dict)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise InvalidRequestError(f"{where}.arguments must be a JSON object as a string, like '{{\"city\": "
                                  "\"Paris\"}'", field=f"{where}.arguments")
    return arguments or "{}"


def answered_call(call_id: str, known: set[str] | None, field: str, what: str) -> str:
    """A tool result's call id must name an earlier call (None: not checked here)."""
    if known is not None and call_id not in known:
        ids = ", ".join(sorted(known)) or "none"
        raise InvalidRequestError(f"{field} {call_id!r} answers no earlier {what} (known ids: {ids}); send the call "
                                  "before its result, or continue the response that made it", field=field)
    return call_id


def input_messages(items: str | list[dict[str, Any]] | None, field: str = "input",
                   known: set[str] | None = None) -> list[dict]:
    """Input items as chat messages: consecutive function_call items become one assistant message's tool_calls,
    a function_call_output a tool message, a reasoning item the next assistant message's reasoning_content.
    `known`: the call ids of the conversation before, when the results are to be checked against them."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    reasoning: str | None = None
    for i, item in enumerate(items):
        where = f"{field}[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise InvalidRequestError(f"{where}.role must be one of {', '.join(MESSAGE_ROLES)} (got {role!r})",
                                          field=f"{where}.role")
            message: dict[str, Any] = {"role": role, "content": part_text(item.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call_id, arguments = _need(item, "call_id", where), _arguments(item.get("arguments"), where)
            call = {"id": call_id, "type": "function",
                    "function": {"name": _need(item, "name", where), "arguments": arguments}}
            if known is not None:
                known.add(call_id)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if reasoning is not None:
                    messages[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            output = part_text(item.get("output"), f"{where}.output")
            call_id = answered_call(_need(item, "call_id", where), known, f"{where}.call_id", "function_call")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = part_text(parts, f"{where}.content")
        else:
            raise UnsupportedFeatureError(f"{where}: input items of type {kind!r} are not supported; send message, "
                                          "function_call, function_call_output or reasoning items", field=where)
    return messages


def input_items(items: str | list[dict[str, Any]] | None) -> list[dict]:
    """The input as items with ids, for GET /v1/responses/{id}/input_items (a string is one user message)."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": items}]}]
    out = []
    for item in items or []:
        kind = item.get("type", "message")
        out.append({"id": f"{ITEM_ID_PREFIX.get(kind, 'item')}_{uuid.uuid4().hex[:24]}", **item, "type": kind})
    return out


def function_tools(tools: list[dict[str, Any]] | None) -> list[dict] | None:
    """Responses' flat function tools ({type, name, parameters}) as chat tools ({type, function: {...}})."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise UnsupportedFeatureError(f"tools[{i}]: " + HOSTED.format(kind=kind), field=f"tools[{i}].type")
        fields = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fields})
    return out


def tool_choice(choice: str | dict[str, Any] | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise UnsupportedFeatureError(f"tool_choice {choice!r} is not supported; send none, auto, required or "
                                  '{"type": "function", "name": "..."}', field="tool_choice")


def response_format(text: dict[str, Any] | None) -> dict | None:
    """text.format as chat's response_format."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise InvalidRequestError('text.format must be an object such as {"type": "json_schema", "name": ..., '
                                  '"schema": {...}}', field="text.format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        if "schema" not in spec:
            raise InvalidRequestError("text.format.schema is missing; json_schema needs the JSON Schema",
                                      field="text.format.schema")
        return {"type": "json_schema", "json_schema": spec}
    raise InvalidRequestError(f"text.format.type must be text, json_object or json_schema (got {fmt.get('type')!r})",
                              field="text.format.type")


def refuse_unsupported(body: ResponsesInput) -> None:
    if body.conversation is not None:
        raise UnsupportedFeatureError("conversation is not supported; chain responses with previous_response_id",
                                      field="conversation")
    if not isinstance(body, CreateResponseRequest):
        return
    if body.background:
        raise UnsupportedFeatureError("background: true is not supported; responses run while the request waits "
                                      "(send stream: true to see progress)", field="background")
    if body.prompt is not None:
        raise UnsupportedFeatureError("prompt (a stored prompt template) is not supported; send input and "
                                      "instructions", field="prompt")
    if body.top_logprobs:
        raise UnsupportedFeatureError("top_logprobs is not supported on /v1/responses; use /v1/chat/completions "
                                      "with logprobs", field="top_logprobs")


def chat_fields(body: ResponsesInput, history: list[dict]) -> dict[str, Any]:
    """The chat completion request (as a dict for ChatCompletionRequest) that runs `body` after `history` (the
    stored conversation previous_response_id names)."""
    refuse_unsupported(body)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else [])
    known = {c["id"] for m in history for c in m.get("tool_calls") or []}
    messages += history + input_messages(body.input, known=known)
    if not messages:
        raise InvalidRequestError("input is missing; send a string or a list of input items", field="input")
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "tools": function_tools(body.tools),
                              "tool_choice": tool_choice(body.tool_choice),
                              "parallel_tool_calls": body.parallel_tool_calls,
                              "response_format": response_format(body.text)}
    if (body.reasoning or {}).get("effort") == "none":
        fields["chat_template_kwargs"] = {"enable_thinking": False}
    if isinstance(body, CreateResponseRequest):
        fields.update(max_completion_tokens=body.max_output_tokens, stream=bool(body.stream))
        fields.update({k: v for k, v in (("temperature", body.temperature), ("top_p", body.top_p)) if v is not None})
    return {k: v for k, v in fields.items() if v is not None}
