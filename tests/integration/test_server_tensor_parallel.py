"""`mlc-cli serve --tensor-parallel-size 2` on the CPU: 8 concurrent requests get one rank's greedy tokens, and a
worker killed mid-service takes the server down cleanly (the request fails with 503, the process exits non-zero,
nothing hangs)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from mlc.engine.llm import LLM
from mlc.engine.sampling_params import SamplingParams
from test_server_support import ServerProcess
from tiny_llama import build_tiny_llama

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

        (worker,) = workers_of(srv.proc.pid)
        os.kill(worker, signal.SIGKILL)
        started = time.monotonic()
        status, body = complete(PROMPTS[0])
        assert status == 503 and "tensor-parallel worker lost" in body["error"]["message"]
        assert srv.proc.wait(timeout=60) != 0  # exits so that a supervisor restarts it
        assert time.monotonic() - started < 60
        assert "rank 1 exited" in srv.log(), srv.log()[-3000:]
