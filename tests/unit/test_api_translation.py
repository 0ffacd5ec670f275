"""The Responses and Messages APIs translated both ways without a server: requests into the chat request the chat
path runs, the chat reader's deltas into output items / content blocks and their stream events, stored responses,
and Anthropic's error shape."""

from __future__ import annotations

import json

import anthropic as anthropic_sdk
import httpx
import httpx2
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.responses import JSONResponse

from mlc.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mlc.errors import InvalidRequestError, NotFoundError, UnsupportedFeatureError
from mlc.server.chat.assistant_output import AssistantOutput
from mlc.server.chat.reasoning import ReasoningSplitter
from mlc.server.chat.tool_parsers import make_parser
from mlc.server.protocol import anthropic
from mlc.server.protocol.responses import CreateResponseRequest
from mlc.server.protocol.responses_input import chat_fields, input_items
from mlc.server.protocol.streaming import sse_event
from mlc.server.response_store import ResponseStore
from mlc.server.routes.chat_run import as_chat
from mlc.server.routes.messages import AnthropicErrors
from mlc.server.routes.messages_format import MessagesStream, content_blocks, stop_reason
from mlc.server.routes.responses_format import ResponsesStream, assistant_message, output_items, request_echo

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def responses_body(**fields) -> CreateResponseRequest:
    return CreateResponseRequest.model_validate(fields)


def messages_body(**fields) -> anthropic.MessagesRequest:
    return anthropic.MessagesRequest.model_validate({"max_tokens": 16, **fields})


def reader() -> AssistantOutput:
    """GLM-style: the reply may open with <think>; tools in the hermes format."""
    return AssistantOutput(ReasoningSplitter(), make_parser("hermes", {"get_weather": WEATHER["parameters"]}))


def outputs(pieces: list[str], finish: str = "stop") -> list[RequestOutput]:
    """Engine outputs of one choice that streams `pieces` (the last one finishes)."""
    metrics = RequestMetrics(0.0, None, None, None, [], 3, 0, 0)
    outs, text = [], ""
    for k, piece in enumerate(pieces):
        text += piece
        last = k == len(pieces) - 1
        o = CompletionOutput(0, text, list(range(k + 1)), finish if last else None, delta_text=piece)
        outs.append(RequestOutput("r", [1, 2, 3], [o], last, metrics))
    return outs


def test_responses_input_items_become_chat_messages():
    body = responses_body(instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text",
                                                                                   "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temp_c": 21}'},
    ], tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=32,
        temperature=0)
    chat = as_chat(chat_fields(body, []))
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert chat.messages[1].content == "Weather in Paris?"
    assistant = chat.messages[2]
    assert assistant.content is None and assistant.reasoning_content == "hm"
    assert assistant.tool_calls[0].id == "call_1" and assistant.tool_calls[0].function.name == "get_weather"
    assert chat.messages[3].tool_call_id == "call_1"
    assert chat.tools[0].function.name == "get_weather" and chat.tool_choice.function.name == "get_weather"
    assert chat.max_completion_tokens == 32 and chat.temperature == 0


def test_responses_history_comes_before_input_and_instructions_do_not_carry_over():
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    fields = chat_fields(responses_body(input="Again", instructions="New rules."), history)
    assert [(m["role"], m["content"]) for m in fields["messages"]] == [
        ("system", "New rules."), ("user", "Hi"), ("assistant", "Hello"), ("user", "Again")]


def test_text_format_json_schema_is_chats_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = as_chat(chat_fields(responses_body(input="x", text={"format": {
        "type": "json_schema", "name": "thing", "schema": schema, "strict": True}}), []))
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == schema
    assert chat_fields(responses_body(input="x", reasoning={"effort": "none"}), [])["chat_template_kwargs"] == {
        "enable_thinking": False}


@pytest.mark.parametrize(("fields", "error", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     UnsupportedFeatureError, "input[0].content[0]"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, UnsupportedFeatureError, "tools[0].type"),
    ({"input": "x", "background": True}, UnsupportedFeatureError, "background"),
    ({"input": "x", "conversation": "conv_1"}, UnsupportedFeatureError, "conversation"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, InvalidRequestError, "input[0].call_id"),
    ({"input": [{"role": "robot", "content": "x"}]}, InvalidRequestError, "input[0].role"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, UnsupportedFeatureError, "input[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "1"}]}, InvalidRequestError,
     "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1"}]}, InvalidRequestError,
     "input[0].arguments"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, InvalidRequestError, "text.format.type"),
    ({}, InvalidRequestError, "input"),
])
def test_responses_refusals_name_the_field(fields, error, param):
    with pytest.raises(error) as caught:
        chat_fields(responses_body(**fields), [])
    assert caught.value.field == param


def test_responses_output_items_and_stored_message():
    reply = reader().reply("<think>Let me see.</think>\n" + CALL_TEXT)
    items = output_items(reply)
    assert [i["type"] for i in items] == ["reasoning", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "Let me see."}]
    assert items[1]["name"] == "get_weather" and json.loads(items[1]["arguments"]) == {"city": "Paris"}
    message = assistant_message(reply)
    assert message["content"] is None and message["tool_calls"][0]["id"] == items[1]["call_id"]
    assert [i["type"] for i in output_items(reader().reply("Hello"))] == ["message"]


def test_responses_stream_event_sequence_assembles_the_whole_reply():
    kept = []
    stream = ResponsesStream("resp-1", 0, "m", request_echo(responses_body(input="x")), reader(),
                             lambda resp, reply: kept.append((resp, reply)))
    events = stream.start()
    outs = outputs(["<think>Hm", "m.</think>\nIt is ", "sunny.", "\n" + CALL_TEXT])
    for out in outs:
        events += stream.chunks(out)
    events += stream.final(outs[-1])
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "It is sunny."
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["usage"]["input_tokens"] == 3 and final["usage"]["output_tokens"] == 4
    assert kept and kept[0][0] is final and kept[0][1].content == "It is sunny."


def test_input_items_get_ids():
    (text,) = input_items("Hi")
    assert text["id"].startswith("msg_") and text["content"] == [{"type": "input_text", "text": "Hi"}]
    call, output = input_items([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                                {"type": "function_call_output", "call_id": "c", "output": "1", "id": "mine"}])
    assert call["id"].startswith("fc_") and output["id"] == "mine"


def test_response_store_bounds_count_and_age():
    now = [0.0]
    store = ResponseStore(capacity=2, max_age_s=10, clock=lambda: now[0])
    for k in range(3):
        store.put({"id": f"r{k}"}, [])
    assert len(store) == 2
    with pytest.raises(NotFoundError, match="evicted"):
        store.get("r0")
    now[0] = 11
    assert len(store) == 0
    store.put({"id": "r3"}, [{"role": "user", "content": "x"}])
    store.delete("r3")
    with pytest.raises(NotFoundError):
        store.delete("r3")


def test_messages_blocks_become_chat_messages():
    body = messages_body(system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Call it.", "signature": ""},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"},
                                     {"type": "text", "text": "And now?"}]},
    ], tools=[{"name": "get_weather", "input_schema": WEATHER["parameters"]}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, stop_sequences=["\n\n"], top_k=5)
    chat = as_chat(anthropic.chat_fields(body))
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[0].content == "Be brief."
    assert chat.messages[2].reasoning_content == "Call it."
    assert chat.messages[2].tool_calls[0].function.arguments == {"city": "Paris"}
    assert chat.messages[3].tool_call_id == "toolu_1" and chat.messages[3].content == "21 C"
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.stop == ["\n\n"] and chat.top_k == 5 and chat.max_tokens == 16


@pytest.mark.parametrize(("fields", "param"), [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305",
                                                                  "name": "web_search"}]}, "tools[0].type"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"messages": [{"role": "user", "content": "x"}], "mcp_servers": [{}]}, "mcp_servers"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "1"}]}]},
     "messages[0].content[0].tool_use_id"),
])
def test_messages_refusals_name_the_field(fields, param):
    with pytest.raises(InvalidRequestError) as caught:
        anthropic.chat_fields(messages_body(**fields))
    assert caught.value.field == param


def test_messages_content_blocks_and_stop_reasons():
    reply = reader().reply("<think>Hm.</think>\nSure. " + CALL_TEXT)
    assert content_blocks(reply) == [
        {"type": "thinking", "thinking": "Hm.", "signature": ""}, {"type": "text", "text": "Sure."},
        {"type": "tool_use", "id": reply.calls[0]["id"], "name": "get_weather", "input": {"city": "Paris"}}]
    assert stop_reason("stop", True, None) == "tool_use"
    assert stop_reason("length", False, None) == "max_tokens"
    assert stop_reason("stop", False, "###") == "stop_sequence"
    assert stop_reason("stop", False, None) == "end_turn"


def test_messages_stream_event_sequence():
    stream = MessagesStream("msg-1", "m", reader(), lambda o: None)
    events = stream.start(3)
    outs = outputs(["<think>Hm", ".</think>\nSure.", " " + CALL_TEXT])
    for out in outs:
        events += stream.chunks(out)
    events += stream.final(outs[-1])
    summary = [(e["type"], e.get("index"), (e.get("delta") or e.get("content_block") or {}).get("type"))
               for e in events]
    assert summary == [
        ("message_start", None, None), ("ping", None, None),
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None), ("message_delta", None, None), ("message_stop", None, None)]
    assert events[0]["message"]["usage"]["input_tokens"] == 3
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert json.loads(events[10]["delta"]["partial_json"]) == {"city": "Paris"}


def test_errors_under_v1_messages_take_anthropics_shape():
    app = FastAPI()

    @app.get("/v1/messages/x")
    @app.get("/v1/other")
    async def fail():
        return JSONResponse({"error": {"message": "no such thing", "type": "x", "param": "model"}}, 404)

    @app.get("/v1/messages/crash")
    async def crash():
        raise RuntimeError("a bug")

    client = TestClient(AnthropicErrors(app), raise_server_exceptions=False)
    shaped, other = client.get("/v1/messages/x").json(), client.get("/v1/other").json()
    crashed = client.get("/v1/messages/crash")
    assert crashed.status_code == 500 and crashed.json()["error"]["type"] == "api_error"
    assert "a bug" not in crashed.text
    assert shaped == {"type": "error", "error": {"type": "not_found_error", "message": "model: no such thing"}}
    assert other["error"]["message"] == "no such thing"


def sdk_transport(events: list[dict], http=httpx):
    """A client of `http` (httpx, or httpx2 for anthropic's client) whose every answer is `events` as this server
    streams them."""
    body = "".join(sse_event(e) for e in events).encode()
    return http.Client(transport=http.MockTransport(
        lambda request: http.Response(200, content=body, headers={"content-type": "text/event-stream"})))


def streamed(stream, pieces: list[str]) -> list[dict]:
    outs = outputs(pieces)
    events = [e for out in outs for e in stream.chunks(out)]
    return events + stream.final(outs[-1])


def test_the_openai_client_assembles_a_streamed_response():
    stream = ResponsesStream("resp-1", 0, "m", request_echo(responses_body(input="x")), reader())
    events = stream.start() + streamed(stream, ["<think>Hm", ".</think>\nIt is sunny.", "\n" + CALL_TEXT])
    client = openai.OpenAI(base_url="http://t/v1", api_key="k", http_client=sdk_transport(events), max_retries=0)
    with client.responses.stream(model="m", input="x") as s:
        final = s.get_final_response()
    assert final.output_text == "It is sunny."
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "Hm." and json.loads(final.output[2].arguments) == {"city": "Paris"}


def test_the_anthropic_client_assembles_a_streamed_message():
    stream = MessagesStream("msg-1", "m", reader(), lambda o: None)
    events = stream.start(3) + streamed(stream, ["<think>Hm", ".</think>\nSure.", " " + CALL_TEXT])
    client = anthropic_sdk.Anthropic(base_url="http://t", api_key="k", http_client=sdk_transport(events, httpx2),
                                     max_retries=0)
    with client.messages.stream(model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}]) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "Hm." and final.content[1].text == "Sure."
    assert final.content[2].input == {"city": "Paris"} and final.stop_reason == "tool_use"
