"""Issue 10's reliability findings against the real server: a 30 MB body is refused without stalling /health, empty
chats are 400s, error messages say what is accepted (never pydantic's tags), token fields stay inside the vocabulary,
and /openapi.json documents what the server enforces."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.support.server_process import ServerProcess

VOCAB = 49152  # smollm2-135m-instruct


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("hardening"), [])
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.terminate()


def post(server, path: str, body=None, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def health_latency_during(server, work) -> tuple[object, list[float]]:
    """`work()`'s result, and how long each /health took while it ran."""
    result, latencies = {}, []
    worker = threading.Thread(target=lambda: result.setdefault("r", work()))
    worker.start()
    while worker.is_alive():
        start = time.perf_counter()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        latencies.append(time.perf_counter() - start)
        time.sleep(0.02)
    worker.join()
    return result["r"], latencies


def test_huge_prompts_are_refused_before_tokenizing_and_health_still_answers(server):
    body = json.dumps({"prompt": ["x" * 1_000_000] * 30, "max_tokens": 4}).encode()  # the finding: 30 MB
    start = time.perf_counter()
    r, latencies = health_latency_during(server, lambda: httpx.post(
        server.url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60))
    took = time.perf_counter() - start
    print(f"\n30 MB /v1/completions refused in {took:.2f}s; /health x{len(latencies)} during it: "
          f"max {max(latencies) * 1000:.0f} ms")
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt[0]" and "characters" in err["message"]
    assert max(latencies) < 2.0


def test_long_tokenizing_runs_off_the_event_loop(server):
    text = "hello world " * 83_000  # ~1M characters: seconds of tokenizing on a small machine
    r, latencies = health_latency_during(server, lambda: post(server, "/tokenize", {"prompt": text}))
    print(f"\n1M-character /tokenize: /health x{len(latencies)} during it: max {max(latencies) * 1000:.0f} ms")
    assert r.status_code == 200 and r.json()["count"] > 100_000
    assert len(latencies) >= 2 and max(latencies) < 2.0


def test_body_over_the_limit_is_a_json_413_before_it_is_read(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 40000000\r\n\r\n{\"prompt\": \"")  # the rest never comes
        answer = b""
        while chunk := s.recv(65536):  # the server closes the connection after its answer
            answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"application/json" in head
    assert json.loads(body)["error"]["code"] == "body_too_large"


@pytest.mark.parametrize("messages,param", [
    ([{"role": "user", "content": ""}], "messages"),
    ([{"role": "user", "content": "\u200b"}], "messages"),
    ([{"role": "user", "content": []}], "messages"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": ""}], "messages[1].content"),
])
def test_empty_chat_is_a_400_as_an_empty_prompt_is(server, messages, param):
    r = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "empty" in r.json()["error"]["message"]


def test_union_errors_name_a_clean_path_and_what_is_accepted(server):
    err = post(server, "/v1/completions", {"prompt": [-1]}).json()["error"]
    assert err["param"] == "prompt[0]" and "constrained" not in err["message"]
    assert "a list of token ids" in err["message"] and f"from 0 to {VOCAB - 1}" in err["message"]


def test_body_errors_say_what_is_wrong(server):
    deep = post_raw(server, b"[" * 10_000 + b"]" * 10_000)
    assert deep.status_code == 400 and "nested too deeply" in deep.json()["error"]["message"]
    for kind in ("text/plain", None):
        r = post_raw(server, json.dumps({"prompt": "hi"}).encode(), kind)
        assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]


def post_raw(server, raw: bytes, content_type: str | None = "application/json") -> httpx.Response:
    headers = {"content-type": content_type} if content_type else {}
    return httpx.post(server.url + "/v1/completions", content=raw, headers=headers, timeout=60)


@pytest.mark.parametrize("extra,param", [
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"top_k": 10**12}, "top_k"),
    ({"top_k": VOCAB + 1}, "top_k"),
    ({"max_tokens": 2**21}, "max_tokens"),
    ({"min_tokens": 2**21}, "min_tokens"),
    ({"n": 65}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"seed": 2**64}, "seed"),
])
def test_out_of_range_values_are_400s_naming_the_field(server, extra, param):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_top_k_up_to_the_vocabulary_is_accepted(server):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_k": VOCAB, "stop_token_ids": [0]})
    assert r.status_code == 200, r.text


def test_openapi_documents_what_the_server_enforces(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    assert "401" in spec["paths"]["/metrics"]["get"]["responses"]
    for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        assert {"400", "401", "413"} <= set(spec["paths"][path]["post"]["responses"]), path
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert "Needs logprobs: true" in chat["top_logprobs"]["description"]
    assert "must be equal" in chat["max_tokens"]["description"]
    assert "not both" in spec["paths"]["/v1/completions"]["post"]["description"]
    assert spec["components"]["schemas"]["CompletionRequest"]["properties"]["top_k"]["maximum"] == 2**20
