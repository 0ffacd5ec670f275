"""Moving KV bytes between a prefill and a decode instance: torch.distributed gloo, one two-rank group per pair.

Each pair's group is a `ProcessGroupGloo` built on the sender's own `TCPStore` (under a prefix per pair), so it
never touches the default process group or the model's tensor-parallel groups. The sender (P, rank 0) hosts the
store; a receiver (D, rank 1) names itself with a fresh pair id, and both sides build the group when the side
channel (the server's `/v1/kv/pull`, outside this module) first pairs them. Every transfer is one flat uint8 buffer
(`kv_transfer.pack`) sent with a tag of its own. A failed transfer drops the pair's group on both sides; the receiver
then starts a new pair with the next pull (and recomputes the request whose pull failed).
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("mlc.engine")


def _group(store: dist.Store, pair: str, rank: int, host: str, timeout: float) -> Any:
    """A two-rank gloo group (typed Any: torch's stubs omit its `_Options`, `send` and `recv`)."""
    gloo: Any = dist.ProcessGroupGloo
    opts = gloo._Options()
    opts._timeout = timedelta(seconds=timeout)
    opts._devices = [gloo.create_device(hostname=host)]
    return gloo(dist.PrefixStore(f"kv/{pair}", store), rank, 2, opts)


class KVSender:
    """P's end: one store, a group and a send queue per receiver."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0) -> None:
        self.host, self.timeout = host, timeout
        listener = socket.create_server((host, port))  # bound to `host` only: torch's own listens on every interface
        self.store = dist.TCPStore(host, int(listener.getsockname()[1]), is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout), master_listen_fd=listener.detach())
        self.port = int(self.store.port)
        self._groups: dict[str, Future[Any]] = {}
        self._queues: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _pair(self, pair: str) -> tuple[Future[Any], ThreadPoolExecutor]:
        with self._lock:
            if pair not in self._queues:
                pool = ThreadPoolExecutor(1, thread_name_prefix=f"mlc-kv-send-{pair[:8]}")
                self._queues[pair] = pool
                self._groups[pair] = pool.submit(_group, self.store, pair, 0, self.host, self.timeout)
            return self._groups[pair], self._queues[pair]

    def send(self, pair: str, tag: int, buf: torch.Tensor) -> Future[None]:
        """Queue `buf` for the receiver of `pair` (the group is built first if it is new); the future fails with the
        transfer."""
        group, pool = self._pair(pair)

        def run() -> None:
            try:
                group.result().send([buf], 1, tag).wait()
            except Exception:
                self.drop(pair)
                raise

        return pool.submit(run)

    def drop(self, pair: str) -> None:
        with self._lock:
            self._groups.pop(pair, None)
            pool = self._queues.pop(pair, None)
        if pool is not None:
            pool.shutdown(wait=False)

    def close(self) -> None:
        for pair in list(self._queues):
            self.drop(pair)


class KVReceiver:
    """D's end: one pair (group) per sender address, rebuilt under a new pair id after a failure."""

    def __init__(self, host: str = "127.0.0.1", timeout: float = 30.0) -> None:
        self.host, self.timeout = host, timeout
        self.me = uuid.uuid4().hex[:12]
        self._gen = itertools.count()
        self._tags = itertools.count(1)
        self._pairs: dict[str, tuple[str, Any]] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def lock(self, address: str) -> threading.Lock:
        """Pulls from one sender run one at a time (the pair's sends and receives stay in step)."""
        with self._lock:
            return self._locks.setdefault(address, threading.Lock())

    def pair_id(self, address: str) -> str:
        with self._lock:
            if address not in self._pairs:
                self._pairs[address] = (f"{self.me}-{next(self._gen)}", None)
            return self._pairs[address][0]

    def next_tag(self) -> int:
        return next(self._tags)

    def recv(self, address: str, tag: int, num_bytes: int) -> torch.Tensor:
        """Receive a transfer the sender was asked for (hold `lock(address)` around the ask and this call); raises
        when it fails or times out, and the pair is dropped."""
        pair = self.pair_id(address)
        try:
            group = self._pairs[address][1]
            if group is None:
                host, port = address.rsplit(":", 1)
                store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=self.timeout))
                group = _group(store, pair, 1, self.host, self.timeout)
                self._pairs[address] = (pair, group)
            buf = torch.empty(num_bytes, dtype=torch.uint8)
            group.recv([buf], 0, tag).wait()
            return buf
        except Exception:
            with self._lock:
                self._pairs.pop(address, None)
            raise
