"""The server with API keys (--api-key and MLC_API_KEY), --strict-input and --audit-log-content."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.support.server_process import MODEL, ServerProcess, wait_for

KEY, ENV_KEYS, WRONG = "flag-key-123", "env-key-a,env-key-b", "wrong-key-zzz"
CHAT = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    srv = ServerProcess(tmp, ["--api-key", KEY, "--strict-input", "--audit-log", str(tmp / "audit.jsonl"),
                              "--audit-log-content"], env={"MLC_API_KEY": ENV_KEYS})
    srv.audit_path = tmp / "audit.jsonl"
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.terminate()


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("path", ["/health", "/ready", "/live", "/"])
def test_open_routes_need_no_key(server, path):
    assert httpx.get(server.url + path).status_code == 200


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/generate"),
                                         ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
                                         ("GET", "/openapi.json")])
def test_other_routes_need_a_key(server, method, path):
    for headers in ({}, bearer(WRONG), {"Authorization": KEY}, {"Authorization": "Basic abc"}):
        body = {"prompt": "x"} if method == "POST" else None
        r = httpx.request(method, server.url + path, headers=headers, json=body)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["type"] == "authentication_error" and r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("key", [KEY, *ENV_KEYS.split(",")])
def test_every_configured_key_works(server, key):
    r = httpx.get(server.url + "/v1/models", headers=bearer(key))
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL


def test_openai_client_with_key(server):
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    r = good.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3)
    assert r.choices[0].message.content
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key=WRONG, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3)


def test_failures_are_logged_without_the_key(server):
    httpx.get(server.url + "/v1/models", headers=bearer(WRONG))
    log = wait_for(lambda: "401" in server.log() and server.log())
    assert "401 GET /v1/models from 127.0.0.1" in log
    assert WRONG not in log and KEY not in log


def test_strict_input_rejects_invisible_characters(server):
    r = httpx.post(server.url + "/generate", headers=bearer(KEY), json={"prompt": "he\u200bllo", "max_new_tokens": 2})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt" and "U+200B" in err["message"] and "--strict-input" in err["message"]
    r = httpx.post(server.url + "/v1/chat/completions", headers=bearer(KEY),
                   json={"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "a\u2060"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].content"
    ok = httpx.post(server.url + "/generate", headers=bearer(KEY), json={"prompt": "hello", "max_new_tokens": 2})
    assert ok.status_code == 200 and ok.headers["x-mlc-stripped-chars"] == "0"


def test_audit_log_content(server):
    r = httpx.post(server.url + "/generate", headers=bearer(KEY),
                   json={"prompt": "Remember this prompt", "max_new_tokens": 3})
    rid, text = r.json()["id"], r.json()["text"]
    assert httpx.get(server.url + "/v1/models").status_code == 401

    def line():
        rows = [json.loads(x) for x in server.audit_path.read_text().splitlines()]
        return next((x for x in rows if x["request_id"] == rid), None)

    record = wait_for(line)
    assert record["prompt"] == "Remember this prompt" and record["output"] == text
    rows = wait_for(lambda: [json.loads(x) for x in server.audit_path.read_text().splitlines()
                             if json.loads(x)["status"] == 401])
    assert rows and rows[-1]["route"] == "/v1/models"
