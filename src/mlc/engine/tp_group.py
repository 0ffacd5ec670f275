"""The driver's side of a tensor-parallel engine: it starts one worker process per extra rank, joins them in a
torch.distributed group as rank 0, and sends every call that touches the model or the KV cache to all of them.

Control and data travel apart. Commands (a step's inputs, a page copy, a LoRA adapter to attach) go to each
worker over its own pipe, so an idle engine holds no collective open and never times out; the activations travel
by torch.distributed collectives inside the model's forward. Every rank runs the same command on its shard, so they
meet in the same collectives. A worker answers each command with "ok" or its error. A worker that dies, or answers
differently from the driver, ends the engine with `EngineDeadError` (the server then answers 503 and exits).
"""

from __future__ import annotations

import datetime
import hmac
import json
import logging
import secrets
import socket
import subprocess
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, NoReturn, TypeVar

import torch

from mlc.distributed.checks import backend_for, rank_device
from mlc.distributed.state import reset_parallel_state, set_parallel_state
from mlc.engine.launch import Launched, current_launcher
from mlc.errors import EngineDeadError

log = logging.getLogger("mlc.engine")
COLLECTIVE_TIMEOUT_S = 300  # a step whose collectives wait this long has lost a rank
START_TIMEOUT_S = 120  # for a worker to start its interpreter and call back
HANDSHAKE_TIMEOUT_S = 10.0  # for a peer on the control port to answer the challenge
T = TypeVar("T")


def _store(host: str, listener: socket.socket, size: int) -> Any:
    """The group's rendezvous store, served from `listener` (bound to `host` only: torch's own would listen on every
    interface)."""
    import torch.distributed as dist

    port = int(listener.getsockname()[1])
    return dist.TCPStore(host, port, size, is_master=True, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                         wait_for_workers=False, master_listen_fd=listener.detach())


def _greet(sock: socket.socket, token: bytes) -> tuple[int, Connection] | None:
    """A worker's control connection and rank, once it has shown it holds the engine's token (the HMAC of a fresh
    nonce) before anything from it is unpickled; None for any other peer. The control port listens on the launcher's
    host, which is a network address when the workers run on other nodes."""
    conn = Connection(sock.detach())
    try:
        nonce = secrets.token_bytes(32)
        conn.send_bytes(nonce)
        if not conn.poll(HANDSHAKE_TIMEOUT_S):
            raise OSError("no answer to the challenge")
        if not hmac.compare_digest(conn.recv_bytes(64), hmac.new(token, nonce, "sha256").digest()):
            raise OSError("a wrong answer to the challenge")
        if not conn.poll(HANDSHAKE_TIMEOUT_S):
            raise OSError("no rank")
        return int.from_bytes(conn.recv_bytes(8), "big"), conn
    except (OSError, EOFError):
        conn.close()
        return None


class TPGroup:
    worker_module = "mlc.engine.tp_worker"  # what each extra rank runs (`PPGroup` runs pipeline stages)
    what = "tensor-parallel"

    def __init__(self, size: int, expert_parallel: bool, device: torch.device, engine_config: dict[str, Any],
                 threads: int) -> None:
        import torch.distributed as dist

        self.size, self.expert_parallel = size, expert_parallel
        self.closed = False
        self.pipes: list[Connection] = []
        self.procs: list[Launched] = []
        self.launcher = current_launcher()
        host = self.launcher.host
        rendezvous = socket.create_server((host, 0))  # the store's, served once the workers have called back
        port = rendezvous.getsockname()[1]
        token = secrets.token_hex(16)
        server = socket.create_server((host, 0))
        server.settimeout(1.0)
        try:
            for rank in range(1, size):
                # a fresh interpreter (not multiprocessing's spawn, which re-imports the user's __main__ script)
                spec = {"rank": rank, "size": size, "host": host, "port": port, "expert_parallel": expert_parallel,
                        "engine": engine_config, "threads": threads, "control": server.getsockname()[1],
                        "device_index": self.launcher.device_index(rank), **self.worker_extra()}
                self.procs.append(self.launcher.start(rank, ["-m", self.worker_module, json.dumps(spec)],
                                                      {"MLC_TP_TOKEN": token}))
            by_rank: dict[int, Connection] = {}
            while len(by_rank) < size - 1:
                greeted = _greet(self._accept(server), token.encode())
                if greeted is None or not 0 < greeted[0] < size or greeted[0] in by_rank:
                    log.warning("a connection that is not one of this engine's workers was refused")
                    if greeted is not None:
                        greeted[1].close()
                    continue
                by_rank[greeted[0]] = greeted[1]
            self.pipes = [by_rank[rank] for rank in range(1, size)]
        except Exception as e:  # nothing half-started: the workers (and their hosts) go, and the sockets
            rendezvous.close()
            self.shutdown()
            raise EngineDeadError(f"the {self.what} workers did not start ({e})") from None
        finally:
            server.close()
        backend = backend_for(device)
        try:
            dist.init_process_group(backend, store=_store(host, rendezvous, size), rank=0, world_size=size,
                                    timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                                    device_id=rank_device(device, 0) if backend != "gloo" else None)
        except Exception as e:
            self.shutdown()
            raise EngineDeadError(f"the {size} {self.what} ranks could not connect ({e})") from None
        self.joined(backend, device)

    def worker_extra(self) -> dict[str, Any]:
        """More of each worker's start spec (a subclass's)."""
        return {}

    def joined(self, backend: str, device: torch.device) -> None:
        """The driver is rank 0 of the group: layers built from now on are its shard."""
        set_parallel_state(0, self.size, self.expert_parallel)
        log.info("tensor parallel: %d ranks over %s (%s)%s", self.size, backend, device.type,
                 ", experts spread over the ranks" if self.expert_parallel else "")

    def _accept(self, server: socket.socket) -> socket.socket:
        """The next worker's control connection; a worker that exits first fails the start at once."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                return server.accept()[0]
            except TimeoutError:
                for rank, proc in enumerate(self.procs, start=1):
                    if proc.poll() is not None:
                        raise OSError(f"rank {rank} exited with code {proc.returncode} before it connected") from None
        raise OSError(f"a worker did not connect within {START_TIMEOUT_S} s")

    def send(self, method: str, *args: Any) -> None:
        """Start `method(*args)` on every worker (the driver then runs its own part, and `collect`s)."""
        self.check_alive()
        for rank, (pipe, proc) in enumerate(zip(self.pipes, self.procs), start=1):
            try:
                pipe.send((method, args))
            except (BrokenPipeError, OSError):
                try:  # a killed worker's pipe can break a moment before the process is seen to exit
                    code = proc.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    self._dead(f"rank {rank} could not be reached to run {method}")
                self._dead(f"rank {rank} exited (code {code}) before {method}")

    def collect(self, method: str, driver_error: Exception | None) -> list[Any]:
        """Each worker's answer to the last command (what it returned, by rank); they must agree with the driver's
        own outcome."""
        details = []
        for rank, (pipe, proc) in enumerate(zip(self.pipes, self.procs), start=1):
            while not pipe.poll(1.0):
                if proc.poll() is not None:
                    self._dead(f"rank {rank} exited (code {proc.returncode}) during {method}")
            try:
                status, detail = pipe.recv()
            except (EOFError, OSError):
                self._dead(f"rank {rank} exited (code {proc.returncode}) during {method}")
            if (status == "ok") != (driver_error is None):
                what = detail if status != "ok" else f"the driver failed alone ({driver_error})"
                self._dead(f"rank {rank} and the driver disagree on {method}: {what}")
            details.append(detail)
        return details

    def run(self, method: str, local: Callable[..., T], *args: Any) -> T:
        """`method(*args)` on every rank: the workers' `Worker.<method>` and the driver's `local(*args)`."""
        self.send(method, *args)
        try:
            result = local(*args)
        except Exception as e:
            exited = [f"rank {rank} exited (code {proc.returncode})"
                      for rank, proc in enumerate(self.procs, start=1) if proc.poll() is not None]
            if exited:
                self._dead(f"{', '.join(exited)} during {method} ({e})")
            self.collect(method, e)
            raise
        self.collect(method, None)
        return result

    def check_alive(self) -> None:
        if self.closed:
            raise EngineDeadError(f"the {self.what} group is shut down")
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                self._dead(f"rank {rank} exited (code {proc.returncode})")

    def _dead(self, why: str) -> NoReturn:
        self.shutdown()
        raise EngineDeadError(f"{self.what} worker lost: {why}; the engine stops")

    def shutdown(self) -> None:
        """Stop the workers and leave the group (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for pipe in self.pipes:
            try:
                if pipe is not None:
                    pipe.send(("stop", ()))
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:  # a remote host that no longer answers: closing it ends it
                    pass
        self.launcher.close()
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a group with a dead rank may not tear down cleanly; the process state is reset
                pass
        reset_parallel_state()
