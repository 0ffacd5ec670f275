"""The server under a small queue and a short timeout: 429 under a flood, finish_reason "timeout", and a
graceful SIGTERM (503 for new requests, in-flight ones cancelled after the grace period, exit code 0); a second
SIGTERM ends in-flight requests at once with finish_reason "abort", never a plain-text 500."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx
import pytest

from tests.support.server_process import ServerProcess, metric, sse_events, wait_for

TIMEOUT_S = 10  # 6 s let the long request of the flood test time out before the flood had arrived on a busy host
LONG = {"prompt": "Write a very long story about the sea.", "max_tokens": 500, "ignore_eos": True}
LONGER = {**LONG, "max_tokens": 4000}  # far longer than TIMEOUT_S at any speed (500 tokens took 5 s on a fast CPU)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("limits"),
                        ["--max-batch-size", "1", "--max-queue", "1", "--request-timeout", str(TIMEOUT_S),
                         "--shutdown-grace", "2", "--max-seq-len", "4096", "--kv-cache-memory", "128MiB"])
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.terminate()


def test_flood_gets_429_with_retry_after(server):
    # One long request holds the only batch slot first (until the request timeout: it cannot end sooner), so the
    # flood meets a full engine whatever this machine's speed: the first request of the flood fills the one queue
    # place and every other one is refused. The long request is not streamed: a stream nobody reads could be cut by
    # the server's slow-client guard and free the slot while the flood is still arriving.
    async def flood():
        async with httpx.AsyncClient(timeout=60) as c:
            long = asyncio.create_task(c.post(server.url + "/v1/completions", json=LONGER))
            deadline = time.monotonic() + 30
            while metric(await asyncio.to_thread(server.metrics), "mlc:num_requests_running") < 1:
                assert time.monotonic() < deadline and not long.done(), "the long request never ran"
                await asyncio.sleep(0.05)
            tasks = [asyncio.create_task(c.post(server.url + "/generate",
                                                json={"prompt": f"Tell {i}", "max_new_tokens": 4}))
                     for i in range(11)]
            while sum(t.done() for t in tasks) < 10 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            long.cancel()  # the client goes away: the server frees the slot for the queued one
            await asyncio.gather(long, return_exceptions=True)
            return await asyncio.gather(*tasks)

    answers = asyncio.run(flood())
    codes = sorted(r.status_code for r in answers)
    assert codes.count(200) == 1 and codes.count(429) == 10, codes
    refused = next(r for r in answers if r.status_code == 429)
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["type"] == "queue_full" and "--max-queue" in refused.json()["error"]["message"]
    assert metric(server.metrics(), "mlc:request_rejected_total", reason="queue_full") >= 10


def test_timeout_ends_with_partial_text(server):
    start = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", json=LONGER, timeout=60)
    assert TIMEOUT_S <= time.monotonic() - start < TIMEOUT_S + 5
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["finish_reason"] == "timeout"
    assert choice["text"] and 0 < r.json()["usage"]["completion_tokens"] < LONGER["max_tokens"]
    with httpx.stream("POST", server.url + "/v1/completions", json={**LONGER, "stream": True}, timeout=60) as s:
        events = sse_events(s)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "timeout"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]).strip()


def test_sigterm_drains_then_exits_cleanly(server):
    result = {}

    def long_request():
        # ignore_eos: the request must still be running when SIGTERM arrives, however fast this machine is
        result["r"] = httpx.post(server.url + "/v1/completions", json=LONG, timeout=60)

    worker = threading.Thread(target=long_request)
    worker.start()
    assert wait_for(lambda: metric(server.metrics(), "mlc:num_requests_running") == 1, timeout=10)
    server.proc.terminate()
    assert wait_for(lambda: httpx.get(server.url + "/health").status_code == 503, timeout=5)
    assert httpx.get(server.url + "/health").json() == {"status": "draining"}
    refused = httpx.post(server.url + "/generate", json={"prompt": "new", "max_new_tokens": 2})
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    worker.join(30)
    r = result["r"]
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["finish_reason"] == "abort" and choice["text"]
    assert server.proc.wait(30) == 0
    assert "Traceback" not in server.log()


def test_second_sigterm_aborts_in_flight_requests_with_json(tmp_path):
    srv = ServerProcess(tmp_path, ["--max-batch-size", "2", "--shutdown-grace", "300"])
    result = {}

    def plain():
        result["plain"] = httpx.post(srv.url + "/v1/completions", json=LONG, timeout=60)

    def streamed():
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": LONG["prompt"]}], "max_tokens": 400, "ignore_eos": True,
                "stream": True}) as s:
            result["stream"] = (s.status_code, s.headers["content-type"], sse_events(s))

    try:
        srv.wait_healthy()
        workers = [threading.Thread(target=f) for f in (plain, streamed)]
        for w in workers:
            w.start()
        assert wait_for(lambda: metric(srv.metrics(), "mlc:num_requests_running") == 2, timeout=20)
        assert wait_for(lambda: metric(srv.metrics(), "mlc:generation_tokens_total") >= 8, timeout=20)  # both have text
        srv.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: httpx.get(srv.url + "/health").status_code == 503, timeout=5)
        srv.proc.send_signal(signal.SIGTERM)  # the grace period (300 s) is cut short
        second = time.monotonic()
        for w in workers:
            w.join(30)
        r = result["plain"]
        assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
        assert r.json()["choices"][0]["finish_reason"] == "abort" and r.json()["choices"][0]["text"]
        status, kind, events = result["stream"]
        assert status == 200 and kind.startswith("text/event-stream") and events[-1] == "[DONE]"
        assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1] == "abort"
        assert srv.proc.wait(30) == 0 and time.monotonic() - second < 20
        assert "Traceback" not in srv.log() and "Exception in ASGI application" not in srv.log()
    finally:
        srv.terminate()
