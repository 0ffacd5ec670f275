"""Tool-call parsers and the reasoning splitter on recorded GLM, hermes and Llama-3 outputs: whole, and streamed
at every split point (inside tags included), which must assemble to exactly the whole reply."""

from __future__ import annotations

import json

import pytest

from mlc.server.chat.assistant_output import AssistantOutput, assemble, finish_reason
from mlc.server.chat.reasoning import ReasoningSplitter, starts_inside, template_reasons
from mlc.server.chat.tool_parsers import make_parser

TOOLS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                     "metric": {"type": "boolean"}, "note": {"type": "string"}},
                    "required": ["city"]},
    "search": {"type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}}},
}

# Recorded shapes: GLM-4.5/4.6 (newlines), GLM-4.7 (no newlines), GLM-4, hermes (Qwen), Llama 3.1.
GLM45 = ("\n<think>The user wants weather.\nI should call the tool.</think>\nLet me check.\n"
         "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n"
         "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>metric</arg_key>\n<arg_value>true</arg_value>\n"
         "<arg_key>note</arg_key>\n<arg_value>42</arg_value>\n</tool_call>\n"
         "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>a <b> c</arg_value>\n"
         "<arg_key>filters</arg_key>\n<arg_value>{'lang': 'zh', 'safe': True}</arg_value>\n</tool_call>")
GLM47 = ("<think></think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
         "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>")
GLM4 = 'get_weather\n{"city": "Beijing", "days": 1}'
HERMES = ('I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}\n</tool_call>')
LLAMA3 = ('<|python_tag|>{"name": "search", "parameters": {"query": "llamas"}}; '
          '{"name": "get_weather", "parameters": {"city": "Oslo"}}')


def stream(fmt: str | None, text: str, cuts: list[int], reasoning: bool = False, inside: bool = False) -> list[dict]:
    out = AssistantOutput(ReasoningSplitter(inside) if reasoning else None,
                          make_parser(fmt, TOOLS) if fmt else None)
    deltas, last = [], 0
    for cut in [*cuts, len(text)]:
        deltas += out.feed(text[last:cut])
        last = cut
    return deltas + out.finish()


def whole(fmt, text, **kw):
    return assemble(stream(fmt, text, [], **kw))


def args(call) -> dict:
    return json.loads(call["function"]["arguments"])


def test_glm45_reasoning_content_and_typed_arguments():
    reply = whole("glm45", GLM45, reasoning=True)
    assert reply.reasoning == "The user wants weather.\nI should call the tool."
    assert reply.content == "Let me check."  # whitespace next to a call is not content
    assert [c["function"]["name"] for c in reply.calls] == ["get_weather", "search"]
    # typed by the schema: note is a string even though "42" reads as JSON; the rest parse as JSON / Python literals
    assert args(reply.calls[0]) == {"city": "北京", "days": 3, "metric": True, "note": "42"}
    assert args(reply.calls[1]) == {"query": "a <b> c", "filters": {"lang": "zh", "safe": True}}
    assert all(c["id"].startswith("call_") for c in reply.calls) and len({c["id"] for c in reply.calls}) == 2


def test_glm47_without_newlines():
    reply = whole("glm45", GLM47, reasoning=True)
    assert reply.content is None and reply.reasoning is None
    assert args(reply.calls[0]) == {"city": "Paris", "days": 2}


def test_glm4_name_line_then_json_and_plain_reply():
    reply = whole("glm4", GLM4)
    assert reply.content is None and args(reply.calls[0]) == {"city": "Beijing", "days": 1}
    plain = whole("glm4", "\nget_weather is a function I can call.")
    assert plain.calls == [] and plain.content == "get_weather is a function I can call."


def test_hermes_and_llama3():
    reply = whole("hermes", HERMES)
    assert reply.content == "I will look."
    assert [args(c) for c in reply.calls] == [{"city": "Paris"}, {"query": "x"}]
    reply = whole("llama3_json", LLAMA3)
    assert [c["function"]["name"] for c in reply.calls] == ["search", "get_weather"]
    assert whole("llama3_json", "No call needed.").content == "No call needed."


@pytest.mark.parametrize("fmt,text", [
    ("glm45", "<tool_call>unknown_fn\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>"),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par"),  # cut by max_tokens
    ("hermes", "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {broken}\n</tool_call>"),
    ("glm4", "get_weather\n{\"city\": "),
    ("llama3_json", "{\"name\": \"nope\", \"parameters\": {}}"),
])
def test_output_that_does_not_parse_is_content(fmt, text):
    reply = whole(fmt, text)
    assert reply.calls == [] and reply.content.strip() == text.strip()


def _splits(text: str) -> list[list[int]]:
    every = [[i] for i in range(1, len(text))]
    return every + [list(range(1, len(text)))]  # one cut anywhere, and one character at a time


@pytest.mark.parametrize("fmt,text,reasoning", [
    ("glm45", GLM45, True), ("glm45", GLM47, True), ("glm4", GLM4, False), ("hermes", HERMES, False),
    ("llama3_json", LLAMA3, False), (None, GLM45, True),
])
def test_streaming_at_every_split_point_assembles_to_the_whole_reply(fmt, text, reasoning):
    want = whole(fmt, text, reasoning=reasoning)
    for cuts in _splits(text):
        got = assemble(stream(fmt, text, cuts, reasoning=reasoning))
        strip = [{k: v for k, v in c.items() if k != "id"} for c in got.calls]
        assert (got.content, got.reasoning, strip) == (
            want.content, want.reasoning, [{k: v for k, v in c.items() if k != "id"} for c in want.calls]), cuts


def test_streaming_never_shows_a_partial_tag_as_content():
    deltas = stream("glm45", GLM45, list(range(1, len(GLM45))), reasoning=True)
    shown = "".join(d.get("content", "") + d.get("reasoning_content", "") for d in deltas)
    assert "<tool_call" not in shown and "</think" not in shown and "<think" not in shown
    kinds = [next(iter(d)) for d in deltas]
    assert kinds.index("content") > kinds.index("reasoning_content")
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0, 1]


def test_reasoning_splitter():
    assert template_reasons("...<think>...") and not template_reasons("{{ messages }}") and not template_reasons(None)
    assert starts_inside("<|assistant|>\n<think>\n") and not starts_inside("<|assistant|>\n<think></think>")
    s = ReasoningSplitter(inside=True)
    assert s.feed("plan a") == [("reasoning", "plan a")]
    assert s.feed("</th") == []
    assert s.feed("ink>\n\nAnswer") == [("content", "Answer")]
    unclosed = ReasoningSplitter()
    assert unclosed.feed("<think>still going") == [("reasoning", "still going")] and unclosed.finish() == []
    plain = ReasoningSplitter()
    assert plain.feed("\n<thi") == [] and plain.feed("s is text") == [("content", "<this is text")]


def test_finish_reason_tool_calls():
    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason("length", True) == "length" and finish_reason("stop", False) == "stop"
