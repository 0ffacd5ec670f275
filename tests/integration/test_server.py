"""The real server process on the default model: both APIs with and without streaming (the `openai` client
included), every bad-input case, invisible characters, disconnects, metrics, the audit log and a post_inference
hook, and the OpenAPI schema."""

from __future__ import annotations

import json
import sys
import time

import httpx
import openai
import pytest

from tests.support.server_process import MODEL, ServerProcess, metric, sse_events, wait_for

HOOK = """
import sys
with open(sys.argv[1], "a", encoding="utf-8") as f:
    f.write(sys.stdin.read().strip() + "\\n")
"""
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    (tmp / "hook.py").write_text(HOOK)
    config = tmp / "mlc-config.yaml"
    config.write_text(json.dumps({"hooks": {"post_inference": [sys.executable, str(tmp / "hook.py"),
                                                                 str(tmp / "hook.jsonl")], "timeout_s": 20}}))
    srv = ServerProcess(tmp, ["--audit-log", str(tmp / "audit.jsonl"), "--context-profile", "qa=64"],
                        env={"MLC_CONFIG": str(config)})
    srv.audit_path, srv.hook_path = tmp / "audit.jsonl", tmp / "hook.jsonl"
    try:
        srv.wait_healthy(probe={"messages": CHAT, "max_tokens": 4})
        yield srv
    finally:
        srv.terminate()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(server, path: str, body=None, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


# health
def test_health_answers_loading_then_healthy(server):
    first_code, first_body = server.health_seen[0]
    assert (first_code, first_body) == (503, {"status": "loading"})
    assert server.health_seen[-1] == (200, {"status": "healthy"})
    assert httpx.get(server.url + "/ready").status_code == 200
    assert httpx.get(server.url + "/live").json() == {"status": "alive"}


def test_requests_while_loading_get_503(server):
    r = server.while_loading
    assert r is not None and r.status_code == 503
    err = r.json()["error"]
    assert "loading" in err["message"] and err["type"] == "service_unavailable"
    assert r.headers["retry-after"]


# native API
def test_generate(server):
    r = post(server, "/generate", {"prompt": "The capital of France is", "max_new_tokens": 8, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["text"].strip() and body["finish_reason"] in ("stop", "length")
    assert len(body["tokens"]) == body["usage"]["completion_tokens"] <= 8
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    assert body["latency_ms"] > 0 and 0 < body["ttft_ms"] <= body["latency_ms"]
    assert r.headers["x-request-id"] == body["id"]
    full = post(server, "/generate", {"prompt": "The capital of France is", "max_new_tokens": 8, "temperature": 0,
                                      "full_kv": True})  # opting out of sparse KV never changes a dense server
    assert full.status_code == 200 and full.json()["tokens"] == body["tokens"]


def test_generate_stream_matches_plain(server):
    req = {"prompt": "The capital of France is", "max_new_tokens": 8, "temperature": 0}
    plain = post(server, "/generate", req).json()
    with httpx.stream("POST", server.url + "/generate", json={**req, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events.pop() == "[DONE]"
    assert all(e["finish_reason"] is None for e in events[:-1])
    last = events[-1]
    assert last["finish_reason"] == plain["finish_reason"]
    assert "".join(e["delta"] for e in events) == last["text"] == plain["text"]
    assert sum((e["tokens"] for e in events), []) == plain["tokens"]
    assert last["usage"] == plain["usage"]


# OpenAI API through the official client
def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    echo = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, echo=True)
    assert echo.choices[0].text == "Once upon a time" + r.choices[0].text


def test_completions_with_several_prompts(client):
    r = client.completions.create(model=MODEL, prompt=["The sky is", "Two plus two is"], max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    single = client.completions.create(model=MODEL, prompt="Two plus two is", max_tokens=4, temperature=0)
    assert r.choices[1].text == single.choices[0].text


def test_chat(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content.strip()
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason


def test_max_completion_tokens(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert len(lp.token_logprobs) == len(lp.tokens) == r.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs)
    for chosen, top, value in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs):
        assert 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(value, abs=1e-4)  # greedy: the chosen token is the top one
        assert chosen in top
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                            top_logprobs=2, stream=True)
    streamed = [t.token for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == [t.token for t in content]


def test_n_samples(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=1.0, n=3, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert 3 <= r.usage.completion_tokens <= 18
    assert len({c.message.content for c in r.choices}) > 1  # different samples from different generators
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, n=2, seed=3, stream=True)
    texts = {0: "", 1: ""}
    for c in stream:
        texts[c.choices[0].index] += c.choices[0].text
    same = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, n=2, seed=3)
    assert texts == {c.index: c.text for c in same.choices}


def test_n_samples_mixed_with_other_sequences_keep_the_engine_alive(server, client):
    """Issue 10's reproducers: forked samples completing in the same step as other sequences used to read past the
    logits and kill the engine for good."""
    r = post(server, "/v1/completions", {"prompt": ["Hello there", "Good morning"], "max_tokens": 4, "n": 2})
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1, 2, 3]
    from concurrent.futures import ThreadPoolExecutor

    def chat(n):
        return client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, n=n)

    def streamed(_):
        body = {"prompt": "Once upon a time", "max_tokens": 4, "n": 2, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as s:
            return s.status_code, [line for line in s.iter_lines() if line.startswith("data: ")][-1]

    with ThreadPoolExecutor(12) as pool:
        assert [len(x.choices) for x in pool.map(chat, [2, 1])] == [2, 1]
        assert all(res == (200, "data: [DONE]") for res in pool.map(streamed, range(12)))
    assert httpx.get(server.url + "/health").status_code == 200


def test_stop_string(client):
    free = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0)
    text = free.choices[0].text
    word = next(w for w in text.split() if text.index(w) > 0)
    r = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0, stop=[word])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(word)]


def test_seed_reproducible(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=10,
                                         temperature=1.0, seed=seed).choices[0].text

    assert sample(11) == sample(11)
    assert len({sample(11), sample(12), sample(13)}) > 1


# tokenizer routes
def test_tokenize_detokenize(server):
    r = post(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 512
    assert "".join(r["token_strs"]) == "Hello world"
    assert post(server, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    chat = post(server, "/tokenize", {"messages": CHAT}).json()
    gen = httpx.post(server.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()
    assert chat["count"] == gen["usage"]["prompt_tokens"]
    bad = post(server, "/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


# bad input: every case a 4xx that names the field
LONG = "hello " * 600
BAD = [
    ("/generate", {"prompt": "hi", "max_new_tokens": 0}, "max_new_tokens"),
    ("/generate", {"prompt": "hi", "max_new_tokens": -5}, "max_new_tokens"),
    ("/generate", {"prompt": "hi", "max_token": 5}, "max_token"),
    ("/generate", {"prompt": "hi", "max_new_tokens": "5"}, "max_new_tokens"),
    ("/generate", {"prompt": 42}, "prompt"),
    ("/generate", {"prompt": ""}, "prompt"),
    ("/generate", {"prompt": "\u200b\u2060"}, "prompt"),
    ("/generate", {"prompt": "hi", "temperature": 2.5}, "temperature"),
    ("/generate", {"prompt": "hi", "temperature": -0.1}, "temperature"),
    ("/generate", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/generate", {"prompt": LONG}, "prompt"),
    ("/generate", {"prompt": "hi", "max_new_tokens": 600}, "max_new_tokens"),
    ("/generate", {"prompt": "hi", "context_length": 100000}, "context_length"),
    ("/generate", {"prompt": "hi", "context_profile": "legal"}, "context_profile"),
    ("/generate", {"prompt": "hi", "stop": ["x"] * 17}, "stop"),
    ("/v1/completions", {"prompt": "", "max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": LONG}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": 3}, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1000}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"999999999": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{p}:{f}" for p, _, f in BAD])
def test_bad_input_is_a_4xx_naming_the_field(server, path, body, param):
    r = post(server, path, body)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]


def test_unknown_model_is_404(server):
    r = post(server, "/v1/chat/completions", {"model": "gpt-4", "messages": CHAT})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("raw", [b'{"prompt": "hi", ', b'{"prompt": "\xff\xfe"}', b"[1, 2]", b""])
def test_malformed_body_is_a_400(server, raw):
    r = httpx.post(server.url + "/generate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "body"


def test_context_profile_bounds_the_request(server):
    ok = post(server, "/generate", {"prompt": "hi", "max_new_tokens": 4, "context_profile": "qa"})
    assert ok.status_code == 200
    r = post(server, "/generate", {"prompt": "hi", "max_new_tokens": 80, "context_profile": "qa"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_new_tokens" and "64" in err["message"]
    r = post(server, "/v1/completions", {"prompt": "hi " * 40, "max_tokens": 30, "context_length": 32})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


# invisible characters
def test_invisible_characters_are_stripped_and_counted(server):
    dirty = "The capital\u200b of France\u2060 is\ufeff"
    r = post(server, "/generate", {"prompt": dirty, "max_new_tokens": 4, "temperature": 0})
    clean = post(server, "/generate", {"prompt": "The capital of France is", "max_new_tokens": 4, "temperature": 0})
    assert r.headers["x-mlc-stripped-chars"] == "3" and r.json()["stripped_chars"] == 3
    assert clean.headers["x-mlc-stripped-chars"] == "0"
    assert r.json()["text"] == clean.json()["text"]
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi\u200b\u200b"}],
                                                   "max_tokens": 2})
    assert chat.json()["stripped_chars"] == 2 and chat.headers["x-mlc-stripped-chars"] == "2"
    joiner = post(server, "/tokenize", {"prompt": "a\u200db"}).json()
    assert joiner["stripped_chars"] == 0  # ZWJ is kept: emoji sequences and Indic scripts need it


# disconnects, metrics
def engine_idle(server):
    m = server.metrics()
    return metric(m, "mlc:num_requests_running") == 0 and metric(m, "mlc:kv_cache_usage_perc") == 0 and m


def test_disconnect_frees_pages(server):
    before = metric(server.metrics(), "mlc:request_success_total", finished_reason="abort")
    body = {"prompt": "Write a long story about a dragon.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        busy = server.metrics()
        assert metric(busy, "mlc:num_requests_running") == 1 and metric(busy, "mlc:kv_cache_usage_perc") > 0
    with pytest.raises(httpx.ReadTimeout):  # non-streaming: the client gives up waiting
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=1.5)
    assert wait_for(lambda: engine_idle(server), timeout=10), server.metrics()
    after = metric(server.metrics(), "mlc:request_success_total", finished_reason="abort")
    assert after - before == 2
    gone = wait_for(lambda: [x for x in audit_lines(server) if x["finish_reason"] == "disconnect"])
    assert sorted(x["status"] for x in gone) == [200, 499]  # the stream had started; the plain one never answered


def test_metrics_have_vllm_like_names(server):
    post(server, "/generate", {"prompt": "hi", "max_new_tokens": 3})
    text = httpx.get(server.url + "/metrics").text
    for name in ["time_to_first_token_seconds", "time_per_output_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds"]:
        assert f"mlc:{name}_bucket" in text and f"mlc:{name}_count" in text
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total"]:
        assert f"mlc:{name}{{" in text, name
    m = server.metrics()
    assert metric(m, "mlc:generation_tokens_total") > 0 and metric(m, "mlc:e2e_request_latency_seconds_count") > 0


# audit log and hooks
def audit_lines(server) -> list[dict]:
    return [json.loads(line) for line in server.audit_path.read_text().splitlines()]


def test_audit_log(server):
    r = post(server, "/generate", {"prompt": "Audit me please", "max_new_tokens": 3})
    rid = r.json()["id"]
    bad = post(server, "/generate", {"prompt": "hi", "max_new_tokens": 0})
    assert bad.status_code == 400
    lines = wait_for(lambda: [x for x in audit_lines(server) if x["request_id"] == rid])
    (line,) = lines
    assert line["route"] == "/generate" and line["status"] == 200 and line["client"] == "127.0.0.1"
    assert line["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert line["completion_tokens"] == r.json()["usage"]["completion_tokens"]
    assert line["latency_ms"] > 0 and line["time"].endswith("+00:00") and line["model"] == MODEL
    assert "prompt" not in line and "output" not in line
    assert "Audit me" not in server.audit_path.read_text()
    assert any(x["status"] == 400 and x["route"] == "/generate" for x in audit_lines(server))


def test_hook_receives_the_audit_record(server):
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})
    rid = r.json()["id"]

    def hooked():
        if not server.hook_path.exists():
            return None
        return [json.loads(x) for x in server.hook_path.read_text().splitlines() if rid in x]

    records = wait_for(hooked, timeout=20)
    assert records and records[0]["route"] == "/v1/chat/completions" and records[0]["status"] == 200
    assert records[0]["completion_tokens"] == r.json()["usage"]["completion_tokens"]


# schema and page
def test_openapi_lists_every_route(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    routes = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    assert routes >= {("GET", "/health"), ("GET", "/ready"), ("GET", "/live"), ("POST", "/generate"),
                      ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                      ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"), ("GET", "/")}
    gen = spec["components"]["schemas"]["GenerateRequest"]
    assert gen["additionalProperties"] is False and "prompt" in gen["required"]
    assert gen["properties"]["max_new_tokens"]["anyOf"][0]["minimum"] == 1
    responses = spec["paths"]["/v1/completions"]["post"]["responses"]
    assert set(responses) >= {"200", "400", "401", "429", "503"} and "422" not in responses  # 400, never 422
    assert "text/event-stream" in responses["200"]["content"]


def test_chat_page(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in r.text


def test_no_tracebacks_in_the_log(server):
    time.sleep(0.2)
    assert "Traceback" not in server.log()


def test_bench_serve_reports_plots_and_json(server, tmp_path):
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "mlc.cli.main", "bench", "serve", "--url", server.url + "/v1", "--concurrency", "1,2",
         "--num-prompts", "3", "--max-tokens", "4", "--ignore-eos", "--warmup", "0", "--plot", str(tmp_path / "b"),
         "--json", str(tmp_path / "b.json")], capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "concurrency 1: 3 ok, 0 failed" in out.stdout and "concurrency 2: 3 ok, 0 failed" in out.stdout
    levels = json.loads((tmp_path / "b.json").read_text())["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2] and all(lv["completed"] == 3 for lv in levels)
    assert all(lv["output_tokens"] == 12 for lv in levels)
    for name in ("throughput", "latency", "latency-cdf"):
        png = tmp_path / f"b-{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
