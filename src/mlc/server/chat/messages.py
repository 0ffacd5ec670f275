"""A chat conversation as the model's chat template takes it: roles (OpenAI's aliases too), text content parts,
the assistant's earlier tool calls and the tool results that answer them, each checked with an error naming its
field; then rendered with the request's tools and tokenized (`render`)."""

from __future__ import annotations

from mlc.errors import InvalidRequestError, UnsupportedFeatureError
from mlc.server.chat.tools import ToolSetup, call_arguments, for_template
from mlc.server.prompting import Prompt, check_chars
from mlc.server.protocol.schemas import ChatMessage
from mlc.server.protocol.schemas_agent import ToolCallIn
from mlc.server.state import ServerState, loaded_engine

ROLE_ALIASES = {"developer": "system", "function": "tool"}  # OpenAI's newer name; its legacy tool result


def chat_messages(state: ServerState, messages: list[ChatMessage]) -> tuple[list[dict], int]:
    """Messages as the chat template takes them ({role, content} with text content; an assistant's tool_calls with
    their arguments as objects; a tool result's tool_call_id and function name), and the characters stripped."""
    out, stripped = [], 0
    calls: dict[str, str] = {}  # tool call id -> function name, from earlier assistant messages
    for i, m in enumerate(messages):
        field = f"messages[{i}].content"
        entry: dict = {"role": ROLE_ALIASES.get(m.role, m.role)}
        calls_in = m.calls
        if calls_in and m.role != "assistant":
            kind = "tool_calls" if m.tool_calls else "function_call"
            raise InvalidRequestError(f"messages[{i}].{kind}: only assistant messages hold tool calls",
                                      field=f"messages[{i}].{kind}")
        if calls_in:
            entry["tool_calls"] = _calls(calls_in, i, calls)
        if m.role in ("tool", "function"):
            entry.update(_tool_result(m, i, calls))
        if m.reasoning_content is not None and m.role == "assistant":
            entry["reasoning_content"] = m.reasoning_content
        content = m.content if m.content is not None else {"assistant": m.refusal, "function": ""}.get(m.role)
        if content is None:
            if calls_in:
                out.append({**entry, "content": None})
                continue
            raise InvalidRequestError(f"{field} is missing; every message needs text content", field=field)
        if isinstance(content, str):
            text = content
        else:
            parts: list[str] = []
            for j, part in enumerate(content):
                if part.type == "refusal":  # an assistant's earlier refusal: what it said
                    if part.refusal is None:
                        raise InvalidRequestError(f"{field}[{j}].refusal is missing; a refusal part needs its text",
                                                  field=f"{field}[{j}].refusal")
                    parts.append(part.refusal)
                    continue
                if part.type != "text":
                    raise UnsupportedFeatureError(
                        f"content part type {part.type!r} is not supported; this model reads text parts only",
                        field=f"{field}[{j}]")
                if part.text is None:
                    raise InvalidRequestError(f"{field}[{j}].text is missing; a text part needs its text",
                                              field=f"{field}[{j}].text")
                parts.append(part.text)
            text = "".join(parts)
        clean, n = state.policy.clean(text, field)
        stripped += n
        out.append({**entry, "content": clean})
    _require_text(out, stripped)
    return out, stripped


def _calls(calls: list[ToolCallIn], i: int, seen: dict[str, str]) -> list[dict]:
    out = []
    for j, call in enumerate(calls):
        field = f"messages[{i}].tool_calls[{j}].function.arguments"
        cid = call.id or f"call_{i}_{j}"
        seen[cid] = call.function.name
        out.append({"id": cid, "type": "function", "function": {
            "name": call.function.name, "arguments": call_arguments(call.function.arguments, field)}})
    return out


def _tool_result(m: ChatMessage, i: int, seen: dict[str, str]) -> dict:
    """A tool message's tool_call_id must answer an earlier call; the function's name comes along for templates
    that show it."""
    if m.tool_call_id is None:
        return {"name": m.name} if m.name else {}
    if m.tool_call_id not in seen:
        known = ", ".join(seen) or "none: no earlier assistant message has tool_calls"
        raise InvalidRequestError(f"messages[{i}].tool_call_id {m.tool_call_id!r} answers no earlier tool call "
                                  f"(known ids: {known})", field=f"messages[{i}].tool_call_id")
    return {"tool_call_id": m.tool_call_id, "name": m.name or seen[m.tool_call_id]}


def _require_text(conversation: list[dict], stripped: int) -> None:
    """An empty chat is a 400, as an empty prompt is: no message with text, or an empty last user message."""
    gone = " once invisible characters are removed" if stripped else ""
    if not any(m["content"] or m.get("tool_calls") for m in conversation):
        raise InvalidRequestError(f"every message's content is empty{gone}; send some text", field="messages")
    users = [i for i, m in enumerate(conversation) if m["role"] == "user"]
    if users and not conversation[users[-1]]["content"]:
        field = f"messages[{users[-1]}].content"
        raise InvalidRequestError(f"{field} is empty{gone}; the last user message needs text", field=field)


def render(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool = True,
           max_tokens: int | None = None, tools: ToolSetup | None = None,
           template_kwargs: dict | None = None) -> Prompt:
    """The prompt of a conversation: tools (if any) rendered as `tools.for_template` decides; `template_kwargs`
    (the request's chat_template_kwargs) passed to the template."""
    conversation, stripped = chat_messages(state, messages)
    check_chars(state, sum(len(m["content"] or "") for m in conversation), max_tokens, "messages")
    conversation, tool_defs = for_template(conversation, tools)
    text, ids = loaded_engine(state).chat_prompt(conversation, add_generation_prompt, tool_defs, template_kwargs)
    return Prompt(ids, text, stripped)

