"""The Responses API and Anthropic's Messages API on the default model, through the real `openai` and `anthropic`
clients, on a server with an API key: text and streamed replies (the same greedy text as chat completions: one
engine path), previous_response_id, function tools forced by name (the default model does not call tools by
itself), structured outputs, stored responses, token counts, x-api-key and Anthropic's error shape."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.support.agent_cases import CLAUDE_TOOL, PERSON, SLOW_LOAD_S, WEATHER, sdk_clients
from tests.support.server_process import MODEL, ServerProcess, metric

KEY = "sk-agent-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
TOOL = {"type": "function", **WEATHER["function"]}
ASK = "What's the weather in Paris for the next 3 days?"
GREEDY = {"temperature": 0}
CLAUDE_GREEDY = {"extra_body": GREEDY}  # anthropic's client no longer has temperature; the server still takes it


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("agent-apis"), ["--api-key", KEY], load_timeout=SLOW_LOAD_S) as srv:
        yield srv


@pytest.fixture(scope="module")
def clients(server):
    return sdk_clients(server.url, KEY)



def chat_text(oai, messages: list[dict], max_tokens: int) -> str:
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, **GREEDY)
    return r.choices[0].message.content


def sse_pairs(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, payload) of a stream that names its events."""
    pairs, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            payload = json.loads(line[len("data: "):])
            assert payload["type"] == name
            pairs.append((name, payload))
    return pairs


def test_response_text_is_the_chat_path_text(oai):
    r = oai.responses.create(model=MODEL, instructions="Be brief.", input="Name a colour.", max_output_tokens=12,
                             **GREEDY)
    expected = chat_text(oai, [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Name a colour."}], 12)
    assert r.output_text == expected and expected.strip()
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens <= 12
    assert [item.type for item in r.output] == ["message"]


def test_response_stream_events_assemble_the_same_text(server, oai):
    body = {"model": MODEL, "input": "Name a colour.", "max_output_tokens": 12, "stream": True, **GREEDY}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        pairs = sse_pairs(r)
    kinds = [k for k, _ in pairs]
    deltas = [p["delta"] for k, p in pairs if k == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and deltas
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", "response.completed"]
    assert [p["sequence_number"] for _, p in pairs] == list(range(len(pairs)))
    whole = oai.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=12, **GREEDY)
    assert "".join(deltas) == whole.output_text == pairs[-1][1]["response"]["output"][0]["content"][0]["text"]
    with oai.responses.stream(model=MODEL, input="Name a colour.", max_output_tokens=12, **GREEDY) as stream:
        assert stream.get_final_response().output_text == whole.output_text


def test_previous_response_id_continues_the_conversation(oai, server):
    first = oai.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=10, **GREEDY)
    second = oai.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                  max_output_tokens=10, **GREEDY)
    history = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "What is my name?"}]
    assert second.output_text == chat_text(oai, history, 10)
    counted = httpx.post(server.url + "/v1/responses/input_tokens", headers=AUTH, timeout=60, json={
        "input": "What is my name?", "previous_response_id": first.id}).json()
    assert counted == {"object": "response.input_tokens", "input_tokens": second.usage.input_tokens}


def test_function_tool_round_trip(oai):
    choice = {"type": "function", "name": "get_weather"}
    first = oai.responses.create(model=MODEL, input=ASK, tools=[TOOL], tool_choice=choice, max_output_tokens=80,
                                 **GREEDY)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}
    chained = oai.responses.create(model=MODEL, previous_response_id=first.id, input=[result], tools=[TOOL],
                                   max_output_tokens=16, **GREEDY)
    explicit = oai.responses.create(model=MODEL, tools=[TOOL], max_output_tokens=16, **GREEDY, input=[
        {"role": "user", "content": ASK}, call.model_dump(exclude_none=True), result])
    assert chained.status in ("completed", "incomplete") and chained.output
    assert chained.usage.input_tokens == explicit.usage.input_tokens
    assert [i.model_dump(exclude={"id", "call_id"}) for i in chained.output] == \
        [i.model_dump(exclude={"id", "call_id"}) for i in explicit.output]


def test_text_format_json_schema(oai):
    r = oai.responses.create(model=MODEL, input="Describe a person.", max_output_tokens=120, **GREEDY, text={
        "format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), PERSON)


def test_stored_responses_get_and_delete(oai, server):
    r = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    got = oai.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    (item,) = oai.responses.input_items.list(r.id).data
    assert item.type == "message" and item.role == "user" and item.content[0].text == "Hi"
    oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        oai.responses.retrieve(r.id)
    unstored = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False)
    missing = httpx.get(f"{server.url}/v1/responses/{unstored.id}", headers=AUTH, timeout=30)
    assert missing.status_code == 404 and "store: false" in missing.json()["error"]["message"]


def test_input_tokens_counts_the_chat_prompt(server):
    counted = httpx.post(server.url + "/v1/responses/input_tokens", headers=AUTH, timeout=60, json={
        "instructions": "Be brief.", "input": "Hello"}).json()
    tokenized = httpx.post(server.url + "/tokenize", headers=AUTH, timeout=60, json={"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]}).json()
    assert counted["input_tokens"] == tokenized["count"] > 0


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, 400,
     "input[0].content[0]"),
    ({"input": "x", "previous_response_id": "resp-unknown"}, 404, "previous_response_id"),
    ({"input": "x", "max_output_token": 5}, 400, "max_output_token"),
])
def test_responses_bad_input_names_the_field(server, body, status, param):
    r = httpx.post(server.url + "/v1/responses", json=body, headers=AUTH, timeout=30)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_message_text_is_the_chat_path_text(claude, oai):
    m = claude.messages.create(model=MODEL, max_tokens=12, system="Be brief.", **CLAUDE_GREEDY,
                               messages=[{"role": "user", "content": "Name a colour."}])
    expected = chat_text(oai, [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Name a colour."}], 12)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == expected
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens <= 12
    counted = claude.messages.count_tokens(model=MODEL, system=[{"type": "text", "text": "Be brief."}],
                                           messages=[{"role": "user", "content": "Name a colour."}])
    assert counted.input_tokens == m.usage.input_tokens


def test_message_stream_event_sequence(server, claude):
    body = {"model": MODEL, "max_tokens": 12, "stream": True, **GREEDY,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=120) as r:
        assert r.status_code == 200
        pairs = sse_pairs(r)
    kinds = [k for k, _ in pairs]
    deltas = [p["delta"]["text"] for k, p in pairs if k == "content_block_delta"]
    assert kinds == ["message_start", "ping", "content_block_start", *["content_block_delta"] * len(deltas),
                     "content_block_stop", "message_delta", "message_stop"] and deltas
    assert pairs[-2][1]["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    with claude.messages.stream(model=MODEL, max_tokens=12, messages=body["messages"], **CLAUDE_GREEDY) as stream:
        assert stream.get_final_message().content[0].text == "".join(deltas)


def test_stop_sequences_name_the_one_that_stopped(claude):
    ask = {"model": MODEL, "max_tokens": 24, "messages": [{"role": "user", "content": "Name three colours."}],
           **CLAUDE_GREEDY}
    text = claude.messages.create(**ask).content[0].text
    word = next(w for w in text.split()[1:] if len(w) > 2)
    m = claude.messages.create(**ask, stop_sequences=["zzzq", word])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert m.content[0].text == text[:text.index(word)]


def test_tool_use_round_trip(claude):
    ask = [{"role": "user", "content": ASK}]
    first = claude.messages.create(model=MODEL, max_tokens=80, messages=ask, tools=[CLAUDE_TOOL], **CLAUDE_GREEDY,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    jsonschema.validate(use.input, CLAUDE_TOOL["input_schema"])
    history = [*ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]}]
    second = claude.messages.create(model=MODEL, max_tokens=16, messages=history, tools=[CLAUDE_TOOL], **CLAUDE_GREEDY)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use") and second.content


def test_x_api_key_and_anthropic_error_shape(server):
    ask = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    assert httpx.post(server.url + "/v1/messages", json=ask, headers={"x-api-key": KEY}, timeout=60).is_success
    assert httpx.post(server.url + "/v1/chat/completions", headers={"x-api-key": KEY}, timeout=60, json={
        "messages": ask["messages"], "max_tokens": 2}).is_success
    for headers in ({"x-api-key": "wrong"}, {}):
        r = httpx.post(server.url + "/v1/messages", json=ask, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "authentication_error" and "x-api-key" in r.json()["error"]["message"]
    cases = [({k: v for k, v in ask.items() if k != "max_tokens"}, "max_tokens"),
             ({**ask, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
             ({**ask, "model": "claude-sonnet-4"}, "claude-sonnet-4")]
    for body, named in cases:
        r = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30)
        assert r.status_code in (400, 404) and set(r.json()) == {"type", "error"}, r.text
        assert r.json()["error"]["type"] in ("invalid_request_error", "not_found_error") and \
            named in r.json()["error"]["message"]


def test_routes_in_openapi_and_metrics(server):
    spec = httpx.get(server.url + "/openapi.json", headers=AUTH, timeout=30).json()
    routes = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    assert routes >= {("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"),
                      ("DELETE", "/v1/responses/{response_id}"), ("POST", "/v1/responses/input_tokens"),
                      ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens")}
    assert {"ResponseStreamEvent", "MessageStreamEvent"} <= set(spec["components"]["schemas"])
    values = server.metrics(headers=AUTH)
    for route in ("/v1/responses", "/v1/messages", "/v1/chat/completions"):
        assert metric(values, "mlc:api_requests_total", route=route, status="200") > 0, route


def test_no_tracebacks_in_the_log(server):
    assert "Traceback" not in server.log()


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_bench_serve_drives_the_responses_and_messages_apis(server, tmp_path, api):
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "mlc.cli.main", "bench", "serve", "--url", server.url, "--api", api, "--api-key", KEY,
         "--concurrency", "1,2", "--num-prompts", "3", "--max-tokens", "4", "--warmup", "1", "--quiet",
         "--json", str(tmp_path / "b.json")], capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"})
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["api"] == api
    for level in result["levels"]:
        assert level["completed"] == 3 and level["failed"] == 0
        assert 3 <= level["output_tokens"] <= 12 and level["prompt_tokens"] > 0  # the API's own usage counts
        assert level["ttft_ms"]["count"] == 3
