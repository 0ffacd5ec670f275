"""`mlc-cli serve --tensor-parallel-size 2` on the CPU: 8 concurrent requests get one rank's greedy tokens, and a
worker killed in the middle of a streamed request takes the server down cleanly (the stream ends with an error
event naming the rank, /health answers 503 until the process exits non-zero, nothing hangs). An idle engine notices
a lost worker too (no request needed)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from mlc.engine.llm import LLM
from mlc.engine.sampling_params import SamplingParams
from tests.support.server_process import ServerProcess
from tests.support.tiny_llama import build_tiny_llama

PROMPTS = [[5 + i, 9, 33, 70 + i, 12, 8, 41 + 3 * i] for i in range(8)]


def workers_of(pid: int) -> list[int]:
    """Pids of the tensor-parallel worker processes the server started."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"mlc.engine.tp_worker" in cmdline:
            found.append(int(entry.name))
    return found


def test_tp2_server_matches_one_rank_then_dies_cleanly(tmp_path):
    model = build_tiny_llama(tmp_path / "llama")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].text for o in LLM(str(model), kv_cache_memory="4MiB").generate(PROMPTS, greedy)]

    def complete(prompt):
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": str(model), "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        return r.status_code, r.json()

    with ServerProcess(tmp_path, ["--tensor-parallel-size", "2"], model=str(model)) as srv:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(complete, PROMPTS))
        assert [status for status, _ in answers] == [200] * 8
        assert [body["choices"][0]["text"] for _, body in answers] == expected
        assert "tensor parallel: 2 ranks over gloo" in srv.log()
        assert "each worker's part in its process (2 ranks)" in srv.log()  # the worker's pages written at start too

        (worker,) = workers_of(srv.proc.pid)
        health: list[int] = []
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
                "model": str(model), "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # the request is being decoded
            os.kill(worker, signal.SIGKILL)
            started = time.monotonic()
            rest = [line for line in lines if line.startswith("data:")]
        assert any("tensor-parallel worker lost" in line and "rank 1" in line for line in rest), rest[-3:]
        while srv.proc.poll() is None and time.monotonic() - started < 60:
            try:
                health.append(httpx.get(srv.url + "/health", timeout=2).status_code)
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        assert srv.proc.wait(timeout=5) != 0  # exits so that a supervisor restarts it
        assert time.monotonic() - started < 60 and 200 not in health, health
        assert "rank 1 exited" in srv.log(), srv.log()[-3000:]


def test_an_idle_engine_notices_a_lost_worker(tmp_path):
    import asyncio

    from mlc.engine.async_engine import AsyncEngine
    engine = LLM(str(build_tiny_llama(tmp_path / "llama")), kv_cache_memory="4MiB", tensor_parallel_size=2).engine
    served = AsyncEngine(engine)
    dead = []
    served.on_dead = dead.append
    loop = asyncio.new_event_loop()
    try:
        served.start(loop)
        os.kill(engine.tp_group.procs[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not dead and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dead and "rank 1 exited" in dead[0].message and served.error is dead[0]
    finally:
        served.stop()
        engine.shutdown()
        loop.close()
