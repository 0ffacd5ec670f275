"""Shared requests and checks of the agentic API tests (tools, structured outputs) through the real `openai`
client; no tests here."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city", "days"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 24},
                                                    "top": {"type": "boolean"}}, "required": ["query"]}}}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    "student": {"type": "boolean"}}, "required": ["name", "age", "pets", "student"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What's the weather in Paris for the next 3 days?"}]
CLAUDE_TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
               "input_schema": WEATHER["function"]["parameters"]}
SLOW_LOAD_S = 400  # a server's model may load this slowly on a busy shared CPU


def sdk_clients(url: str, key: str = "unused") -> tuple[openai.OpenAI, anthropic.Anthropic]:
    """The openai client (at /v1) and the anthropic client (at the root) of a server, without retries."""
    return (openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=180),
            anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=180))


def check_calls(choice, names=None) -> list:
    """A reply that called tools: finish_reason tool_calls, each call known, its arguments valid for its schema."""
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls, choice
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


def assemble_stream(chunks) -> tuple[str, list[dict], str | None, str]:
    """(content, tool calls, finish_reason, reasoning) put together from stream chunks."""
    content, reasoning, calls, reason = "", "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            entry["name"] += (tc.function.name or "") if tc.function else ""
            entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
        reason = chunk.choices[0].finish_reason or reason
    return content, [calls[k] for k in sorted(calls)], reason, reasoning


def json_objects(client, model: str, count: int, per_request: int = 4, **kw) -> list[dict]:
    """`count` replies under the PERSON schema (strict json_schema), each validated; returns them."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    objects, seed = [], 0
    while len(objects) < count:
        n = min(per_request, count - len(objects))
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Invent a person."}],
                                           response_format=fmt, n=n, max_tokens=200, temperature=1.0, seed=seed, **kw)
        for choice in r.choices:
            obj = json.loads(choice.message.content)
            jsonschema.validate(obj, PERSON)
            objects.append(obj)
        seed += 1
    return objects
