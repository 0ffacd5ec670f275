"""Start the real `mlc-cli serve` process on a free localhost port (shared by the test_server* modules; no tests)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

MODEL = "smollm2-135m-instruct"
BASE_ARGS = ["--kv-cache-memory", "48MiB", "--max-seq-len", "512", "--max-batch-size", "4", "--no-access-log"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, tmp: Path, args: list[str], env: dict[str, str] | None = None, model: str = MODEL,
                 load_timeout: float = 120.0):
        self.tmp = tmp
        self.load_timeout = load_timeout  # for `with`: how long the model may take to load
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "server.log"
        self.health_seen: list[tuple[int, dict]] = []
        self.while_loading: httpx.Response | None = None
        child_env = {k: v for k, v in os.environ.items() if k != "MLC_API_KEY"}
        child_env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                          "TOKENIZERS_PARALLELISM": "false", "MLC_CONFIG": str(tmp / "no-user-config.yaml")})
        child_env.update(env or {})
        cmd = [sys.executable, "-m", "mlc.cli.main", "serve", "--model", model, "--host", "127.0.0.1",
               "--port", str(self.port), *BASE_ARGS, *args]
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(cmd, env=child_env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 120.0, probe: dict | None = None) -> None:
        """Poll /health until 200, keeping what it answered; `probe` is POSTed to /v1/chat/completions once while
        the model still loads."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            self.health_seen.append((r.status_code, r.json()))
            if r.status_code == 200:
                return
            if probe is not None and self.while_loading is None:
                self.while_loading = httpx.post(self.url + "/v1/chat/completions", json=probe, timeout=10)
            time.sleep(0.1)
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.log()}")

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def __enter__(self) -> ServerProcess:
        """`with ServerProcess(...) as srv:` waits until it is healthy and terminates it on the way out."""
        try:
            self.wait_healthy(self.load_timeout)
        except BaseException:
            self.terminate()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.terminate()

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def metric(values: dict[str, float], name: str, **labels) -> float:
    """The value of `name` whose labels include `labels` (0 when absent)."""
    for key, value in values.items():
        if key.split("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            return value
    return 0.0


def sse_events(response: httpx.Response) -> list:
    """The JSON payloads of an SSE response (and "[DONE]" as a string)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()
