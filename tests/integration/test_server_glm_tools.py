"""The agentic API on tiny random GLM-4 and GLM-4.5 checkpoints (built-in templates, no flag to choose the format):
forced tool calls always parse in each model's own format, calls and results round-trip through the template,
GLM-4.5 reasoning comes apart as reasoning_content (whole and streamed), and 50 json_schema replies validate."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.agent_cases import ASK, TOOLS, assemble_stream, check_calls, json_objects
from tests.support.server_process import ServerProcess
from tests.support.tiny_glm import build_tiny_glm


def _serve(tmp_path_factory, moe: bool, args: list[str]):
    tmp = tmp_path_factory.mktemp("glm45" if moe else "glm4")
    model = build_tiny_glm(tmp / "model", moe)
    srv = ServerProcess(tmp, ["--served-model-name", "tiny", "--max-seq-len", "4096", *args], model=str(model))
    srv.wait_healthy()
    return srv


class _Agent:
    def client(self, server):
        return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def test_forced_calls_always_parse(self, server):
        client = self.client(server)
        for seed in range(4):
            r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                               max_tokens=200, temperature=1.0, seed=seed)
            check_calls(r.choices[0])
        named = {"type": "function", "function": {"name": "get_weather"}}
        stream = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=named,
                                                max_tokens=200, temperature=0, stream=True)
        _, calls, reason, _ = assemble_stream(stream)
        assert reason == "tool_calls" and [c["name"] for c in calls] == ["get_weather"]

    def test_calls_and_results_round_trip(self, server):
        client = self.client(server)
        first = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                               max_tokens=200, temperature=0)
        message = first.choices[0].message
        history = [*ASK, message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": '{"temp_c": 21}'}]
        r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=8)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")

    def test_fifty_json_schema_replies_validate(self, server):
        assert len(json_objects(self.client(server), "tiny", 50)) == 50


class TestGlm4(_Agent):
    @pytest.fixture(scope="class")
    def server(self, tmp_path_factory):
        srv = _serve(tmp_path_factory, False, ["--tool-call-parser", "chatglm"])  # vLLM's alias of glm4
        yield srv
        srv.terminate()


class TestGlm45(_Agent):
    @pytest.fixture(scope="class")
    def server(self, tmp_path_factory):
        srv = _serve(tmp_path_factory, True, [])
        yield srv
        srv.terminate()

    def test_reasoning_comes_apart_whole_and_streamed(self, server):
        client = self.client(server)
        # the random model says what the grammar lets it: a thought, then an answer (the tags are added tokens:
        # a Lark grammar names them as tokens)
        lark = 'start: "\\n" <think> /[a-z]{2,8}/ </think> "\\n" /[a-z]{2,8}/'
        body = dict(model="tiny", messages=[{"role": "user", "content": "Think, then answer."}], max_tokens=60,
                    temperature=0, extra_body={"guided_grammar": lark})
        r = client.chat.completions.create(**body)
        message = r.choices[0].message
        assert message.reasoning_content and message.content and message.content.isalpha()
        assert "<think>" not in message.content + message.reasoning_content
        content, calls, _, reasoning = assemble_stream(client.chat.completions.create(**body, stream=True))
        assert (content, reasoning, calls) == (message.content, message.reasoning_content, [])
        raw = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 30, "temperature": 0,
                                                               "guided_grammar": lark})
        assert raw.json()["choices"][0]["text"].startswith("\n<think>")  # completions keep the raw text

    def test_chat_template_kwargs_reach_the_template(self, server):
        client = self.client(server)
        r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert r.usage.prompt_tokens > client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=4, temperature=0).usage.prompt_tokens  # "/nothink<think></think>"

    def test_thinking_switch_of_the_responses_and_messages_apis_reaches_the_template(self, server):
        def count(path: str, body: dict) -> int:
            return httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=60).json()["input_tokens"]

        on = count("/v1/responses/input_tokens", {"input": ASK})
        assert count("/v1/responses/input_tokens", {"input": ASK, "reasoning": {"effort": "none"}}) > on
        off = count("/v1/messages/count_tokens", {"messages": ASK, "thinking": {"type": "disabled"}})
        assert off > count("/v1/messages/count_tokens", {"messages": ASK, "thinking": {"type": "enabled",
                                                                                      "budget_tokens": 1024}}) == on
        assert count("/v1/messages/count_tokens", {"messages": ASK}) == off  # Anthropic's API thinks only if asked
