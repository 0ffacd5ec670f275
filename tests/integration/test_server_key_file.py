"""The server with --api-key-file: named keys beside a plain --api-key, a per-key limit answered 429 with
Retry-After, per-key metrics and the audit log under the key's name (never the key), a bad file refused at start,
and SIGHUP reloading the file while a stream runs on (a bad file on reload keeps the old keys)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from mlc.server.keys import hash_key
from tests.support.server_process import MODEL, ServerProcess, metric, sse_events, wait_for

PLAIN, ALICE, BOB, CAROL = "plain-key-1", "mlc-alice-key", "mlc-bob-key", "mlc-carol-key"


def key_file(*entries: tuple[str, str, dict]) -> str:
    lines = ["keys:"]
    for name, key, limits in entries:
        lines += [f"  - name: {name}", f"    key_sha256: {hash_key(key)}"]
        lines += [f"    {k}: {v}" for k, v in limits.items()]
    return "\n".join(lines) + "\n"


FIRST = key_file(("alice", ALICE, {"requests_per_minute": 3}), ("bob", BOB, {}))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keyfile")
    (tmp / "keys.yaml").write_text(FIRST)
    srv = ServerProcess(tmp, ["--api-key", PLAIN, "--api-key-file", str(tmp / "keys.yaml"),
                              "--audit-log", str(tmp / "audit.jsonl")])
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.terminate()


def generate(server, key: str, max_tokens: int = 2, **kw) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": MODEL, "prompt": "Hello", "max_tokens": max_tokens, **kw})


def test_named_and_plain_keys_work_and_are_counted_by_name(server):
    for key in (PLAIN, BOB, BOB):
        assert generate(server, key).status_code == 200
    assert generate(server, "mlc-unknown").status_code == 401
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {BOB}"}).text
    assert BOB not in text and hash_key(BOB) not in text
    values = server.metrics({"Authorization": f"Bearer {PLAIN}"})
    assert metric(values, "mlc:key_requests_total", key="bob") == 2
    assert metric(values, "mlc:key_tokens_total", key="bob", kind="completion") == 4
    assert metric(values, "mlc:key_requests_in_flight", key="bob") == 0
    records = [json.loads(line) for line in (server.tmp / "audit.jsonl").read_text().splitlines()]
    completions = [r for r in records if r["route"] == "/v1/completions" and r["status"] == 200]
    assert [r.get("key_name") for r in completions[:3]] == [None, "bob", "bob"]
    assert BOB not in (server.tmp / "audit.jsonl").read_text()


def test_a_key_over_its_limit_gets_429_with_retry_after(server):
    codes = [generate(server, ALICE).status_code for _ in range(3)]
    assert codes == [200, 200, 200]
    r = generate(server, ALICE)
    assert r.status_code == 429, r.text
    assert 1 <= int(r.headers["retry-after"]) <= 60
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("rate_limit_exceeded", "requests_per_minute")
    assert generate(server, BOB).status_code == 200  # another key is not limited by alice's minute
    values = server.metrics({"Authorization": f"Bearer {PLAIN}"})
    assert metric(values, "mlc:key_rate_limited_total", key="alice", limit="requests_per_minute") == 1


def test_sighup_reloads_the_file_without_dropping_a_stream(server):
    done: dict = {}

    def stream() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {BOB}"},
                          timeout=120, json={"model": MODEL, "prompt": "Count:", "max_tokens": 60,
                                             "stream": True, "ignore_eos": True}) as r:
            done["events"] = sse_events(r)

    thread = threading.Thread(target=stream)
    thread.start()
    wait_for(lambda: metric(server.metrics({"Authorization": f"Bearer {PLAIN}"}), "mlc:key_requests_in_flight",
                            key="bob") == 1, timeout=30)
    (server.tmp / "keys.yaml").write_text(key_file(("bob", BOB, {}), ("carol", CAROL, {})))
    server.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: generate(server, CAROL).status_code == 200, timeout=10)
    assert generate(server, ALICE).status_code == 401  # alice left the file
    thread.join(120)
    events = done["events"]
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"

    (server.tmp / "keys.yaml").write_text("keys:\n  - name: broken\n")
    server.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: "reloading the API key file failed" in server.log(), timeout=10)
    assert generate(server, CAROL).status_code == 200 and server.proc.poll() is None


def test_a_bad_key_file_is_refused_at_start(tmp_path):
    bad = tmp_path / "keys.yaml"
    bad.write_text(FIRST.replace("requests_per_minute: 3", "requests_per_minute: many"))
    r = subprocess.run([sys.executable, "-m", "mlc.cli.main", "serve", "--model", MODEL, "--api-key-file", str(bad)],
                       capture_output=True, text=True, timeout=120,
                       env={"MLC_CONFIG": str(tmp_path / "none.yaml"), **_env()})
    assert r.returncode == 2, r.stderr
    assert f"{bad}:4: field 'requests_per_minute'" in r.stderr


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "MLC_API_KEY"}
