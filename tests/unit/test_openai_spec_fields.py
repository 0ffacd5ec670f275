"""OpenAI's published request schemas: every field is accepted (null where the spec allows it), the SDK's dumped
assistant message is history, what cannot be done here is a 400 naming the field, the legacy functions become
tools, reasoning_effort switches GLM thinking, prompt_cache_key routes, and --api-lenient drops unknown fields."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion
from pydantic import ValidationError

from mlc.cluster.affinity import affinity_keys
from mlc.server.chat.assistant_output import AssistantOutput, finish_reason
from mlc.server.chat.request import template_kwargs
from mlc.server.chat.tool_parsers import make_parser
from mlc.server.chat.tools import requested_tools
from mlc.server.errors import describe_validation_error
from mlc.server.lenient import drop_fields
from mlc.server.observability.audit import AuditInfo, build_record
from mlc.server.protocol.schemas import AssistantMessage, ChatCompletionRequest, CompletionRequest
from mlc.server.protocol.schemas_openai import unsupported_capability
from tests.support.openai_spec import load

USER = {"role": "user", "content": "Hi"}


def sdk_assistant_message(**message) -> dict:
    """What `resp.choices[0].message.model_dump()` gives a client of the openai SDK."""
    choice = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", **message}}
    resp = ChatCompletion.model_validate({"id": "x", "object": "chat.completion", "created": 1, "model": "m",
                                          "choices": [choice]})
    return resp.choices[0].message.model_dump()


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [USER], **fields})


def test_the_sdks_dumped_assistant_message_is_accepted_as_history():
    text = sdk_assistant_message(content="Hello!")
    call = sdk_assistant_message(content=None, tool_calls=[
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}])
    assert {"refusal", "annotations", "audio", "function_call", "tool_calls"} <= set(text)
    body = ChatCompletionRequest.model_validate({"messages": [USER, text, USER, call, {
        "role": "tool", "tool_call_id": "call_1", "content": "ok"}]})
    assert body.messages[1].content == "Hello!" and body.messages[3].calls[0].function.name == "f"


SPEC_FIELDS = {
    "store": True, "metadata": {"team": "a"}, "service_tier": "priority", "prompt_cache_key": "tenant-7",
    "safety_identifier": "user-hash", "reasoning_effort": "low", "verbosity": "high", "modalities": ["text"],
    "prediction": {"type": "content", "content": "a draft"}, "audio": None, "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "30m"}, "parallel_tool_calls": False, "web_search_options": None,
    "moderation": None, "logit_bias": {"42": 5}, "user": "u1", "seed": -3,
    "stream_options": {"include_usage": True, "include_obfuscation": False},
}


@pytest.mark.parametrize("field", sorted(SPEC_FIELDS))
def test_each_spec_field_is_accepted(field):
    body = chat(**{field: SPEC_FIELDS[field]})
    assert unsupported_capability(body) is None


def test_every_field_of_the_published_requests_is_known():
    schemas = load()["components"]["schemas"]

    def props(name: str) -> set[str]:
        parts = schemas[name].get("allOf", [schemas[name]])
        return {p for part in parts for p in (props(part["$ref"].split("/")[-1]) if "$ref" in part
                                              else part.get("properties", {}))}

    assert props("CreateChatCompletionRequest") <= set(ChatCompletionRequest.model_fields)
    assert props("CreateCompletionRequest") <= set(CompletionRequest.model_fields)


NULLABLE = ["temperature", "top_p", "n", "stream", "stop", "presence_penalty", "frequency_penalty", "seed",
            "logit_bias", "logprobs", "top_logprobs", "max_tokens", "max_completion_tokens", "stream_options",
            "service_tier", "reasoning_effort", "verbosity", "modalities", "audio", "prediction", "store",
            "metadata", "prompt_cache_key", "prompt_cache_retention", "safety_identifier", "moderation", "tools",
            "tool_choice", "response_format"]


def test_null_is_the_default_wherever_the_spec_allows_null():
    body = chat(**{f: None for f in NULLABLE})
    assert (body.temperature, body.top_p, body.n, body.stream, body.logprobs) == (1.0, 1.0, 1, False, False)
    completion = CompletionRequest.model_validate({"prompt": "x", "echo": None, "best_of": None, "suffix": None,
                                                   "logprobs": None, "max_tokens": None, "temperature": None})
    assert completion.echo is False and completion.temperature == 1.0
    schema = ChatCompletionRequest.model_json_schema()["properties"]["temperature"]
    assert {"type": "null"} in schema["anyOf"]


def test_seeds_of_the_whole_int64_range_are_taken_modulo_2_63():
    assert chat(seed=-1).seed == 2**63 - 1 and chat(seed=7).seed == 7


@pytest.mark.parametrize("fields,param", [
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
])
def test_what_cannot_be_done_here_names_the_field_and_why(fields, param):
    field, why = unsupported_capability(chat(**fields))
    assert field == param and "not available" in why


@pytest.mark.parametrize("bias,problem", [({"abc": 1}, "pattern"), ({"5": 101}, "less than or equal to 100")])
def test_a_bad_logit_bias_is_a_400_naming_it(bias, problem):
    with pytest.raises(ValidationError) as e:
        chat(logit_bias=bias)
    errors = [{**err, "loc": ("body", *err["loc"])} for err in e.value.errors()]
    message, param, _ = describe_validation_error(errors)
    assert param.startswith("logit_bias") and problem in message


FN = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_legacy_functions_become_function_tools_with_one_call():
    body = chat(functions=[FN], function_call={"name": "get_weather"})
    asked = requested_tools(body.tools, body.tool_choice, body.parallel_tool_calls, body.functions,
                            body.function_call)
    assert asked.legacy and asked.parallel is False and asked.tools[0].function.name == "get_weather"
    assert asked.choice.function.name == "get_weather"
    auto = chat(functions=[FN], function_call="auto")
    assert requested_tools(None, None, None, auto.functions, auto.function_call).choice == "auto"


def test_legacy_functions_and_tools_together_are_a_400():
    from mlc.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as e:
        requested_tools([{"type": "function", "function": FN}], None, None, chat(functions=[FN]).functions, None)
    assert e.value.field == "functions"


def test_a_legacy_reply_carries_function_call_and_its_finish_reason():
    reader = AssistantOutput(None, make_parser("hermes", {"get_weather": FN["parameters"]}), legacy=True)
    reply = reader.reply('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert reply.calls == [] and reply.function_call == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert finish_reason("stop", True, legacy=True) == "function_call"
    dumped = AssistantMessage(content=None, function_call=reply.function_call).model_dump(mode="json")
    assert "tool_calls" not in dumped and dumped["refusal"] is None


def test_legacy_history_function_call_and_function_role_are_accepted():
    body = ChatCompletionRequest.model_validate({"messages": [
        USER, {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
        {"role": "function", "name": "f", "content": "sunny"}]})
    assert body.messages[1].calls[0].function.name == "f" and body.messages[2].role == "function"


def test_allowed_tools_narrows_the_tools():
    tools = [{"type": "function", "function": FN}, {"type": "function", "function": {"name": "other"}}]
    body = chat(tools=tools, tool_choice={"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "other"}}]}})
    asked = requested_tools(body.tools, body.tool_choice, None, None, None)
    assert [t.function.name for t in asked.tools] == ["other"] and asked.choice == "required"


GLM_TEMPLATE = "{% if enable_thinking is defined and not enable_thinking %}/nothink{% endif %}"


@pytest.mark.parametrize("effort,thinking", [("none", False), ("minimal", False), ("low", True), ("high", True)])
def test_reasoning_effort_is_the_thinking_switch(effort, thinking):
    assert template_kwargs(chat(reasoning_effort=effort), GLM_TEMPLATE) == {"enable_thinking": thinking}


def test_reasoning_effort_yields_to_chat_template_kwargs_and_to_templates_without_the_switch():
    body = chat(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
    assert template_kwargs(body, GLM_TEMPLATE) == {"enable_thinking": True}
    assert template_kwargs(chat(reasoning_effort="none"), "{{ messages }}") is None


def test_prompt_cache_key_is_the_routing_key():
    def keys(**extra):
        body = {"model": "m", "messages": [{"role": "user", "content": "x" * 100}], **extra}
        return affinity_keys("/v1/chat/completions", json.dumps(body).encode(), 32)

    assert keys(prompt_cache_key="t1") == keys(prompt_cache_key="t1", messages=[USER])
    assert keys(prompt_cache_key="t1") != keys(prompt_cache_key="t2") and len(keys()) == 3


def test_tenant_fields_go_to_the_audit_record():
    info = AuditInfo(user="u1", safety_identifier="s1", service_tier="flex")
    record = build_record({"client": ("1.2.3.4", 5)}, 200, 0.1, info, "m", False)
    assert (record["user"], record["safety_identifier"], record["service_tier"]) == ("u1", "s1", "flex")
    assert "user" not in build_record({}, 200, 0.1, AuditInfo(), "m", False)


def test_lenient_mode_drops_unknown_fields_at_any_depth():
    body = {"messages": [{"role": "user", "content": "hi", "colour": "red"}], "max_token": 3}
    locs = [("body", "messages", 0, "colour"), ("body", "max_token")]
    assert drop_fields(body, locs) == ["messages[0].colour", "max_token"]
    assert body == {"messages": [{"role": "user", "content": "hi"}]}
