"""Engine supervision seen from outside, on the real server process: a request whose step fails gets a 500 that
says so while the others are served and /health stays 200; an engine that cannot recover makes the process drain
and exit non-zero (for systemd, Kubernetes or Ray to restart it), never sit at 503 forever.

Faults are injected into the child process by a `sitecustomize` module on its PYTHONPATH."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.server_process import ServerProcess, wait_for

POISON = 12345
FAULT = f"""
import os
import time
import mlc.engine.model_runner as mr

_run = mr.ModelRunner.run

def run(self, scheduled):
    mode = os.environ["MLC_TEST_FAULT"]
    poisoned = any({POISON} in s.seq.prompt_ids for s in scheduled)
    if mode == "hang" and poisoned:
        time.sleep(12)
    elif mode == "always" or poisoned:
        raise RuntimeError("injected fault")
    return _run(self, scheduled)

mr.ModelRunner.run = run
"""


def faulty_server(tmp, mode: str, args: list[str] | None = None) -> ServerProcess:
    (tmp / "sitecustomize.py").write_text(FAULT)
    return ServerProcess(tmp, args or [], env={"PYTHONPATH": str(tmp), "MLC_TEST_FAULT": mode})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = faulty_server(tmp_path_factory.mktemp("poison"), "poison")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.terminate()


def complete(server, prompt, max_tokens=24):
    return httpx.post(server.url + "/v1/completions", timeout=60,
                      json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def test_a_failing_request_gets_a_500_and_the_others_are_served(server):
    alone = complete(server, "The sea is").json()["choices"][0]["text"]
    with ThreadPoolExecutor(4) as pool:
        good = [pool.submit(complete, server, "The sea is") for _ in range(3)]
        time.sleep(0.3)  # the good ones are decoding when the poisoned one joins their batch
        bad = complete(server, [1, 2, POISON, 4])
        good = [f.result() for f in good]
    assert bad.status_code == 500
    err = bad.json()["error"]
    assert err["type"] == "engine_error" and "recovered" in err["message"] and "injected fault" in err["message"]
    assert [r.status_code for r in good] == [200, 200, 200]
    assert all(r.json()["choices"][0]["text"] == alone for r in good)  # untouched by the failure next to them
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_failing_stream_ends_with_an_error_event(server):
    body = {"prompt": [POISON, 5, 6], "max_tokens": 8, "stream": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 500 and r.json()["error"]["type"] == "engine_error"
    assert complete(server, "Hello", 4).status_code == 200


def test_an_engine_beyond_repair_exits_non_zero(tmp_path):
    srv = faulty_server(tmp_path, "always")
    try:
        srv.wait_healthy()
        codes = [complete(srv, f"Hello {i}", 4).status_code for i in range(3)]
        assert codes[:2] == [500, 500] and codes[2] in (500, 503)
        assert wait_for(lambda: srv.proc.poll() is not None, timeout=30), "the server kept running"
        assert srv.proc.returncode == 1
        assert "engine steps failed in a row" in srv.log()
    finally:
        srv.terminate()


def test_a_hung_step_still_answers_the_timeout(tmp_path):
    """The timeout aborts through the engine; when a step hangs, the request ends by itself after a short grace."""
    srv = faulty_server(tmp_path, "hang", ["--request-timeout", "2"])
    try:
        srv.wait_healthy()
        t0 = time.monotonic()
        r = complete(srv, [1, 2, POISON], 4)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
        assert time.monotonic() - t0 < 8  # 2 s timeout + 2 s grace, well before the 12 s step ends
    finally:
        srv.terminate()
