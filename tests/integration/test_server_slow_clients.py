"""Slow and idle clients against the real server (`server/connections.py`): a request head sent a line at a time
(slowloris) and a body sent a byte at a time are cut at their deadlines, logged and counted; hundreds of idle
connections and slow stream readers never block /health or a normal request; past --max-connections new requests
get 503, and the server serves again once connections close."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from tests.support.server_process import ServerProcess, metric, wait_for

CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("slow"), ["--header-timeout", "1", "--body-timeout", "1",
                                                          "--keep-alive-timeout", "30", "--max-connections", "400"])
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.terminate()


def _connect(srv: ServerProcess) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    s.settimeout(10)
    return s


def _closed_after(s: socket.socket) -> float:
    """Seconds until the server closes `s` (recv returns b"" or the connection is reset)."""
    t = time.monotonic()
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - t


def test_a_request_head_sent_a_line_at_a_time_is_cut_at_the_header_deadline(server):
    before = metric(server.metrics(), "mlc:connections_closed_total", reason="head_timeout")
    s = _connect(server)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line that ends the head
    stop = threading.Event()

    def drip():  # slowloris: one more header line every half second, for longer than the deadline
        for i in range(8):
            if stop.wait(0.5):
                return
            try:
                s.sendall(f"X-Drip-{i}: y\r\n".encode())
            except OSError:
                return

    threading.Thread(target=drip, daemon=True).start()
    took = _closed_after(s)
    stop.set()
    assert 0.8 < took < 3.0
    assert wait_for(lambda: metric(server.metrics(), "mlc:connections_closed_total", reason="head_timeout") > before)
    assert "its request head did not arrive within 1 s (--header-timeout)" in server.log()


def test_a_body_sent_a_byte_at_a_time_is_cut_at_the_body_deadline(server):
    s = _connect(server)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 400\r\n\r\n{\"messages\"")
    took = _closed_after(s)
    assert 0.8 < took < 3.0
    assert wait_for(lambda: metric(server.metrics(), "mlc:connections_closed_total", reason="body_timeout") >= 1)
    assert "its request body did not arrive within 1 s (--body-timeout)" in server.log()


def test_a_keep_alive_connection_serves_requests_with_pauses_between_them(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:  # one connection, reused
        assert c.get("/health").status_code == 200
        time.sleep(1.5)  # longer than the header deadline: idle between requests is the keep-alive timeout's job
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_idle_connections_and_slow_readers_do_not_block_health_or_requests(server):
    idle = [_connect(server) for _ in range(200)]  # cut at the header deadline, then replaced: always ~200 open
    readers = []
    for _ in range(10):  # streams read one small chunk a second
        s = _connect(server)
        body = b'{"messages":[{"role":"user","content":"Count to fifty."}],"max_tokens":64,"stream":true}'
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        readers.append(s)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for _ in range(20):
                assert c.get("/health").status_code == 200
            r = c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
        for s in readers:
            assert s.recv(1).startswith(b"H")  # the slow readers' streams are there, waiting for them
    finally:
        for s in idle + readers:
            s.close()


def test_past_max_connections_new_requests_get_503_then_serve_again(tmp_path):
    with ServerProcess(tmp_path, ["--max-connections", "8", "--header-timeout", "30"]) as srv:
        held = [_connect(srv) for _ in range(10)]
        time.sleep(0.3)
        r = httpx.get(srv.url + "/health", timeout=10)
        assert r.status_code == 503
        for s in held:
            s.close()
        assert wait_for(lambda: httpx.get(srv.url + "/health", timeout=10).status_code == 200)
