"""The client matrix: a real `mlc-cli serve` on the default model, driven by the clients users install from PyPI
(openai: chat, streaming, tools, structured outputs, Responses whole and streamed, a two-turn previous_response_id;
the OpenAI Agents SDK on its Responses model with a function tool; anthropic: messages, streaming, a tool round trip,
count_tokens; langchain-openai: invoke, stream, bind_tools, with_structured_output). Each asserts the content it
gets back: the same greedy answer through every API (they share one engine path), a fact the model knows, arguments
valid for the tool's schema, JSON valid for the schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.support.agent_cases import (
    ASK,
    CLAUDE_TOOL,
    PERSON,
    SLOW_LOAD_S,
    TOOLS,
    WEATHER,
    assemble_stream,
    check_calls,
    sdk_clients,
)
from tests.support.server_process import MODEL, ServerProcess

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France? Answer in one word."
FACT = "Paris"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("matrix"), [], load_timeout=SLOW_LOAD_S) as srv:
        yield srv


@pytest.fixture(scope="module")
def clients(server):
    return sdk_clients(server.url)



@pytest.fixture(scope="module")
def answer(oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=16,
                                    temperature=0)
    text = r.choices[0].message.content
    assert FACT in text, text
    return text


def test_openai_chat_streaming_tools_and_structured_outputs(oai, answer):
    stream = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                         max_tokens=16, temperature=0, stream=True)
    assert assemble_stream(stream)[0] == answer
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80,
                                    temperature=0)
    check_calls(r.choices[0])
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a person."}],
                                    max_tokens=120, temperature=0, response_format=fmt)
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_openai_responses_whole_streamed_and_chained(oai, answer):
    whole = oai.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0)
    assert whole.output_text == answer
    with oai.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        assert "".join(deltas) == stream.get_final_response().output_text == answer
    second = oai.responses.create(model=MODEL, input="And of Italy? One word.", previous_response_id=whole.id,
                                  max_output_tokens=16, temperature=0)
    history = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": answer},
               {"role": "user", "content": "And of Italy? One word."}]
    chat = oai.chat.completions.create(model=MODEL, messages=history, max_tokens=16, temperature=0)
    assert second.output_text == chat.choices[0].message.content and second.output_text.strip()


def test_openai_responses_function_tool(oai):
    tool = {"type": "function", **WEATHER["function"]}
    r = oai.responses.create(model=MODEL, input=ASK[0]["content"], tools=[tool], tool_choice="required",
                             max_output_tokens=80, temperature=0)
    (call,) = [item for item in r.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    done = oai.responses.create(model=MODEL, previous_response_id=r.id, tools=[tool], max_output_tokens=24,
                                temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                       "output": '{"forecast": "sunny, 21 C"}'}])
    assert done.output_text.strip() or any(item.type == "function_call" for item in done.output)


def test_anthropic_messages_streaming_tools_and_count(claude, answer):
    ask = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": QUESTION}],
           "extra_body": {"temperature": 0}}
    m = claude.messages.create(**ask)
    assert m.content[0].text == answer and m.stop_reason in ("end_turn", "max_tokens")
    with claude.messages.stream(**ask) as stream:
        assert "".join(stream.text_stream) == answer
    assert claude.messages.count_tokens(model=MODEL, messages=ask["messages"]).input_tokens == m.usage.input_tokens
    first = claude.messages.create(model=MODEL, max_tokens=80, messages=ASK, tools=[CLAUDE_TOOL],
                                   tool_choice={"type": "any"}, extra_body={"temperature": 0})
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use"
    jsonschema.validate(use.input, CLAUDE_TOOL["input_schema"])
    history = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": "sunny, 21 C"}]}]
    second = claude.messages.create(model=MODEL, max_tokens=24, messages=history, tools=[CLAUDE_TOOL],
                                    extra_body={"temperature": 0})
    assert second.content and (second.content[0].type == "tool_use" or second.content[0].text.strip())


def test_openai_agents_sdk_on_its_default_responses_model_with_a_function_tool(server):
    """The Agents SDK's own loop over /v1/responses: the model must call the tool (required), the SDK runs it and
    stops on its result."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no trace export: nothing leaves 127.0.0.1
    calls = []

    @function_tool
    def get_weather(city: str, days: int) -> str:
        """Current weather in a city."""
        calls.append((city, days))
        return f"sunny in {city} for {days} days"

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
    agent = Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather],
                  model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=80),
                  tool_use_behavior="stop_on_first_tool")
    result = Runner.run_sync(agent, ASK[0]["content"])
    assert len(calls) == 1 and isinstance(calls[0][0], str) and 1 <= calls[0][1] <= 7
    assert result.final_output == f"sunny in {calls[0][0]} for {calls[0][1]} days"


def test_langchain_openai_invoke_stream_tools_and_structured_output(server, answer):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="none", temperature=0, max_tokens=16)
    assert llm.invoke(QUESTION).content == answer
    assert "".join(chunk.content for chunk in llm.stream(QUESTION)) == answer
    roomy = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="none", temperature=0, max_tokens=120)
    called = roomy.bind_tools([WEATHER], tool_choice="required").invoke(ASK[0]["content"])
    (call,) = called.tool_calls[:1]
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER["function"]["parameters"])
    structured = roomy.with_structured_output({**PERSON, "title": "person"}, method="json_schema")
    jsonschema.validate(structured.invoke("Describe a person."), PERSON)
