"""The agentic API on the default model through the real `openai` client: tool calls (required, named, streamed,
round trip), structured outputs (json_schema, json_object, vLLM's extras), echo with logprobs, and every bad input
as a 400 naming its field. The default model's template knows no tools: it gets the generic hermes prompt."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from tests.support.agent_cases import ASK, TOOLS, assemble_stream, check_calls, json_objects
from tests.support.server_process import MODEL, ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("tools"), ["--max-batch-size", "4"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def test_tool_choice_required_always_yields_a_parsed_call(client):
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=80, temperature=1.0, seed=seed)
        assert len(check_calls(r.choices[0])) == 1 and r.choices[0].message.content is None


def test_named_tool_streams_the_same_call_as_without_streaming(client):
    choice = {"type": "function", "function": {"name": "search"}}
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                           max_tokens=80, temperature=0)
    (call,) = check_calls(whole.choices[0], names=["search"])
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                            max_tokens=80, temperature=0, stream=True)
    content, calls, reason, _ = assemble_stream(stream)
    assert reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [("search", call.function.arguments)]


def test_tool_results_round_trip(client, server):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=80, temperature=0)
    message = first.choices[0].message
    history = [*ASK, message.model_dump(),  # as the SDK dumps it: refusal, annotations, audio, function_call null
               {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": '{"temp_c": 21}'}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=16, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    history[-1]["tool_call_id"] = "call_unknown"
    bad = post(server, "/v1/chat/completions", {"messages": history, "tools": TOOLS, "max_tokens": 4})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[2].tool_call_id"


def test_json_schema_replies_validate(client):
    assert len(json_objects(client, MODEL, 8)) == 8


@pytest.mark.slow
def test_fifty_json_schema_replies_validate(client):
    assert len(json_objects(client, MODEL, 50)) == 50


def test_json_object_and_vllm_extras(client):
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Describe a cat."}], max_tokens=60, temperature=0)
    r = client.chat.completions.create(**chat, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(**chat, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.chat.completions.create(**chat, extra_body={"guided_regex": r"[0-9]{3}-[A-Z]{2}"})
    assert re.fullmatch(r"[0-9]{3}-[A-Z]{2}", r.choices[0].message.content)
    r = client.chat.completions.create(**chat, extra_body={"guided_grammar": 'root ::= "ok" | "no"'})
    assert r.choices[0].message.content in ("ok", "no")
    c = client.completions.create(model=MODEL, prompt="A person:", max_tokens=60, temperature=0,
                                  extra_body={"guided_json": {"type": "object",
                                                              "properties": {"n": {"type": "integer"}},
                                                              "required": ["n"], "additionalProperties": False}})
    assert isinstance(json.loads(c.choices[0].text)["n"], int)


def test_echo_with_logprobs_scores_the_prompt(client):
    """lm-eval's local-completions reads a continuation's logprob from the echoed prompt."""
    prompt = "The capital of France is"
    nxt = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1)
    word = nxt.choices[0].text
    echo = client.completions.create(model=MODEL, prompt=prompt + word, max_tokens=1, temperature=0, logprobs=1,
                                     echo=True)
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text.startswith(prompt + word)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[-2] == word and len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset)
    assert abs(lp.token_logprobs[-2] - nxt.choices[0].logprobs.token_logprobs[0]) < 0.05
    assert lp.top_logprobs[-2] == {word: lp.token_logprobs[-2]}


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[p for _, p in BAD])
def test_bad_agentic_input_is_a_400_naming_the_field(server, extra, param):
    r = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
