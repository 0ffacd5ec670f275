"""Servers that `bench compare` starts and stops: ours (`mlc-cli serve` on its defaults) and llama.cpp's
`llama-server` on the same GGUF file. Each runs as a child process with its log in the output directory."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from mlc.errors import MlcError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerSpec:
    label: str
    argv: list[str]
    port: int
    log: Path
    health: str = "/health"
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def ours(model: str, log_dir: Path, extra: list[str] | None = None) -> ServerSpec:
    port = free_port()
    argv = [sys.executable, "-m", "mlc.cli.main", "serve", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--no-access-log", "--log-level", "warning", *(extra or [])]
    return ServerSpec("mlc serve (defaults)" if not extra else f"mlc serve {' '.join(extra)}", argv, port,
                      log_dir / f"mlc-serve-{port}.log")


def llama(server: Path, gguf: Path, log_dir: Path, threads: int, parallel: int, context: int) -> ServerSpec:
    """llama-server as a user starts it for concurrent clients: `-np` slots sharing one `-c` token KV pool
    (`-kvu`, so one long prompt may use more than its 1/np share)."""
    port = free_port()
    argv = [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-np", str(parallel), "-c", str(context), "-kvu"]
    return ServerSpec(f"llama-server -t {threads} -np {parallel} -c {context} -kvu", argv, port,
                      log_dir / f"llama-server-{port}.log")


def _die_with_parent() -> None:
    """In the child before exec: on Linux, get SIGTERM when the benchmark process dies, so that a killed
    benchmark never leaves servers running (they would skew whatever runs next)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class ServerStartError(MlcError):
    """A benchmarked server exited, or never became healthy, while starting."""

    def __init__(self, message: str, returncode: int | None = None):
        super().__init__(message)
        self.returncode = returncode

    @property
    def crashed(self) -> bool:
        return self.returncode is not None and self.returncode < 0  # killed by a signal (SIGSEGV, SIGABRT, ...)

    @property
    def signal(self) -> int | None:
        """The signal that killed it, where it crashed."""
        return -self.returncode if self.returncode is not None and self.returncode < 0 else None


def without_repacking(spec: ServerSpec) -> ServerSpec:
    """llama-server with `--no-repack`: its repacked CPU weight layouts (the AMX path among them) crash at start on
    some CPUs; the plain layout is what it runs everywhere else."""
    port = free_port()
    argv = [*spec.argv, "--no-repack"]
    argv[argv.index("--port") + 1] = str(port)
    return ServerSpec(f"{spec.label} --no-repack", argv, port, spec.log.with_name(f"llama-server-{port}.log"))


class RunningServer:
    """Context manager: start the server, wait until its health route answers 200, stop it on exit."""

    def __init__(self, spec: ServerSpec, start_timeout_s: float = 600.0):
        self.spec = spec
        self.timeout = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0

    def __enter__(self) -> RunningServer:
        self.spec.log.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.spec.log, "w")
        start = time.perf_counter()
        self.proc = subprocess.Popen(self.spec.argv, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **self.spec.env}, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        log.close()
        deadline = start + self.timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                tail = self.spec.log.read_text(errors="replace")[-800:]
                raise ServerStartError(f"{self.spec.label} exited with {self.proc.returncode} while starting "
                                       f"(log: {self.spec.log}):\n{tail}", self.proc.returncode)
            try:
                if httpx.get(self.spec.url + self.spec.health, timeout=2).status_code == 200:
                    self.startup_s = time.perf_counter() - start
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise ServerStartError(
            f"{self.spec.label} did not become healthy within {self.timeout:.0f}s; see {self.spec.log}")

    def peak_rss_bytes(self) -> int | None:
        """The server's peak resident memory so far: VmHWM of its process plus that of each live descendant (a
        tensor-parallel worker, a launcher's child); None once it has exited or where /proc cannot tell."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        total, todo, seen = 0, [self.proc.pid], set()
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                total += next(int(ln.split()[1]) * 1024 for ln in status.splitlines() if ln.startswith("VmHWM:"))
                for task in Path(f"/proc/{pid}/task").iterdir():
                    todo += [int(c) for c in (task / "children").read_text().split()]
            except (OSError, StopIteration, ValueError):
                if pid == self.proc.pid:
                    return None
        return total

    def __exit__(self, *exc) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
