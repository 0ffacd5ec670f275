"""OpenAI's published request schemas on a real server (default model, --api-lenient) through the `openai` client:
the SDK's dumped reply sent back as history, the spec's other fields, logit_bias, the legacy functions, GET
/v1/models/{id}, the 400s for what cannot be done here, and unknown fields ignored and named in a header."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.support.agent_cases import ASK, WEATHER
from tests.support.server_process import ServerProcess

MODEL = "local/smollm2-135m"  # a served id with a slash, as hub ids have


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec")
    args = ["--api-lenient", "--audit-log", str(tmp / "audit.jsonl"), "--served-model-name", MODEL]
    with ServerProcess(tmp, args) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=120)


HI = [{"role": "user", "content": "Say hello."}]


def test_the_sdks_dumped_reply_goes_back_as_history_with_the_spec_fields(client, server):
    first = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0)
    dumped = first.choices[0].message.model_dump()
    assert dumped["refusal"] is None and "tool_calls" in dumped
    again = client.chat.completions.create(
        model=MODEL, messages=[*HI, dumped, {"role": "user", "content": "Once more."}], max_tokens=8,
        temperature=0, store=False, metadata={"team": "a"}, service_tier="auto", prompt_cache_key="tenant-1",
        safety_identifier="hash-1", user="u-1", reasoning_effort="low", verbosity="low", modalities=["text"],
        prediction={"type": "content", "content": "Hello"}, audio=None, prompt_cache_retention="24h",
        parallel_tool_calls=True, logprobs=None, top_logprobs=None, n=None, presence_penalty=None)
    assert again.choices[0].message.content and again.choices[0].finish_reason in ("stop", "length")
    records = [json.loads(line) for line in (server.tmp / "audit.jsonl").read_text().splitlines()]
    assert {"user": "u-1", "safety_identifier": "hash-1", "service_tier": "auto"}.items() <= records[-1].items()


def test_prediction_does_not_change_the_output(client):
    plain = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=12, temperature=0)
    predicted = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=12, temperature=0,
                                               prediction={"type": "content", "content": "Hello there!"})
    assert predicted.choices[0].message.content == plain.choices[0].message.content


def test_logit_bias_forces_and_bans_through_the_api(client, server):
    plain = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=0, logprobs=True)
    first = plain.choices[0].logprobs.content[0].token
    forced = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                                       logit_bias={"28": 100}, logprobs=0)
    assert len(set(forced.choices[0].logprobs.tokens)) == 1
    banned_id = httpx.post(server.url + "/tokenize", json={"prompt": first, "add_special_tokens": False},
                           timeout=30).json()["tokens"][0]
    banned = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=0, logprobs=True,
                                            logit_bias={str(banned_id): -100})
    assert banned.choices[0].logprobs.content[0].token != first


def test_legacy_functions_answer_with_function_call(client, server):
    fn = WEATHER["function"]
    r = client.chat.completions.create(model=MODEL, messages=ASK, functions=[fn],
                                       function_call={"name": fn["name"]}, max_tokens=80, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    assert choice.message.function_call.name == "get_weather"
    json.loads(choice.message.function_call.arguments)
    history = [*ASK, choice.message.model_dump(), {"role": "function", "name": "get_weather", "content": "sunny"}]
    after = client.chat.completions.create(model=MODEL, messages=history, functions=[fn], max_tokens=8,
                                           temperature=0)
    assert after.choices[0].finish_reason in ("stop", "length", "function_call")
    stream = post(server, {"messages": ASK, "functions": [fn], "function_call": {"name": fn["name"]},
                           "max_tokens": 80, "temperature": 0, "stream": True})
    events = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    deltas = [e["choices"][0] for e in events if e["choices"]]
    assert any("function_call" in d["delta"] for d in deltas) and deltas[-1]["finish_reason"] == "function_call"


def test_models_by_id(client, server):
    assert client.models.retrieve(MODEL).id == MODEL  # the SDK sends the slash %2F-encoded
    assert httpx.get(f"{server.url}/v1/models/{MODEL}", timeout=10).json()["id"] == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    r = httpx.get(server.url + "/v1/models/gpt-4o", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("field,value", [("modalities", ["text", "audio"]),
                                         ("audio", {"voice": "alloy", "format": "wav"}),
                                         ("web_search_options", {"search_context_size": "low"})])
def test_what_cannot_be_done_here_is_a_400_naming_the_field(server, field, value):
    r = post(server, {"messages": HI, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert "not available" in r.json()["error"]["message"]


def test_lenient_mode_ignores_unknown_fields_and_names_them(server):
    r = post(server, {"messages": [{"role": "user", "content": "Hi", "colour": "red"}], "max_token": 3,
                      "max_tokens": 3})
    assert r.status_code == 200 and r.headers["x-mlc-ignored-fields"] == "messages[0].colour,max_token"
    assert "ignored unknown field(s) messages[0].colour, max_token" in server.log()
    bad = post(server, {"messages": HI, "max_token": 3, "temperature": 9})  # a real error is still a 400
    assert bad.status_code == 400 and "x-mlc-ignored-fields" not in bad.headers
