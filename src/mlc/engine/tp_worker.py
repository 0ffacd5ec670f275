"""A tensor-parallel worker process: rank r of the group. It loads its shard of the model, allocates its shard of
the KV cache, then runs the driver's commands (`mlc.engine.tp_group`) until told to stop or the driver is gone."""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from mlc.config.engine_config import EngineConfig
    from mlc.engine.model_runner import ModelRunner, StepInputs
    from mlc.engine.page_manager import PageCopy
    from mlc.models.base import CausalLM


def _die_with_parent() -> None:
    """Exit when the driver process is gone (its pipe also closes, but a rank blocked in a collective would wait
    for the collective timeout first)."""
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="mlc-tp-parent", daemon=True).start()


class CacheHolder:
    """A worker process's KV cache once the driver has sized it, and the runner over it (`cache_spec` says which
    of the model's KV groups it holds)."""

    model: CausalLM
    _runner: ModelRunner | None = None

    def cache_spec(self) -> list[dict[str, tuple[int, ...]]]:
        return self.model.kv_cache_spec()

    @property
    def runner(self) -> ModelRunner:
        if self._runner is None:
            raise RuntimeError("the driver sent a step before init_cache")
        return self._runner

    def touch_cache(self) -> int:
        return self.runner.touch_cache()

    def init_cache(self, num_pages: int, page_size: int, kv_cache_dtype: str) -> None:
        from mlc.engine.kv_cache import KVCache, kv_dtype
        from mlc.engine.model_runner import ModelRunner

        dtype = kv_dtype(kv_cache_dtype, self.model.dtype)
        cache = KVCache(self.cache_spec(), num_pages, page_size, dtype, self.model.device)
        self._runner = ModelRunner(self.model, cache)


class Worker(CacheHolder):
    """What rank r holds: its model shard, and its KV-cache shard once the driver has sized the cache."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        from mlc.models.loader import load_model

        self.model = load_model(config.model, device, config.dtype, config.weight_dtype, verify=False)

    def execute(self, step: StepInputs) -> None:
        self.runner.execute(step)

    def apply_copies(self, copies: list[PageCopy]) -> None:
        self.runner.apply_copies(copies)

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.runner.move_slots(src, dst)

    def attach_adapter(self, adapter_id: int, name: str, path: str, max_rank: int | None = None) -> None:
        self.runner.attach_adapter(adapter_id, name, path, max_rank)

    def detach_adapter(self, adapter_id: int) -> None:
        self.runner.detach_adapter(adapter_id)


def _connect(host: str, control_port: int, rank: int) -> Connection:
    """The control pipe to the driver: answer its challenge with the token HMAC, then say the rank (tp_group._greet)."""
    import hashlib
    import hmac
    import socket

    conn = Connection(socket.create_connection((host, control_port)).detach())
    nonce = conn.recv_bytes(64)
    conn.send_bytes(hmac.new(os.environ.get("MLC_TP_TOKEN", "").encode(), nonce, hashlib.sha256).digest())
    conn.send_bytes(rank.to_bytes(8, "big"))
    return conn


def join_group(rank: int, size: int, host: str, port: int, engine: dict[str, Any], threads: int, control: int,
               device_index: int, label: str) -> tuple[Connection, EngineConfig, torch.device]:
    """A worker process's start (tensor-parallel rank or pipeline stage): exit with the process that started it,
    connect the control pipe to the driver at `host`, log as `label`, join the driver's process group. Returns the
    pipe, the engine config and this rank's device (accelerator `device_index` of those this process sees)."""
    _die_with_parent()
    pipe = _connect(host, control, rank)
    logging.basicConfig(level=os.environ.get("MLC_LOG_LEVEL", "WARNING"), format=f"{label} %(message)s")
    import torch
    import torch.distributed as dist

    from mlc.config.device import resolve_device
    from mlc.config.engine_config import EngineConfig
    from mlc.distributed.checks import backend_for, rank_device
    from mlc.engine.tp_group import COLLECTIVE_TIMEOUT_S

    torch.set_num_threads(threads)
    config = EngineConfig(**engine)
    device = rank_device(resolve_device(config.device), device_index)
    backend = backend_for(device)
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)  # the driver serves it (tp_group)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout,
                            device_id=device if backend != "gloo" else None)
    return pipe, config, device


def serve_commands(pipe: Connection, build: Callable[[], Any],
                   call: Callable[[Any, str, tuple[Any, ...]], Any]) -> None:
    """Build this process's part (`build`), answer "ok" or its error, then run the driver's commands (`call(part,
    method, args)`, whose result goes back with the "ok") until "stop" or the driver is gone; leave the group."""
    import torch.distributed as dist

    part = None
    try:
        part = build()
        pipe.send(("ok", None))
    except Exception as e:
        pipe.send(("error", f"{type(e).__name__}: {e}"))
    while True:
        try:
            method, args = pipe.recv()
        except (EOFError, OSError):
            break  # the driver is gone
        if method == "stop":
            break
        try:
            pipe.send(("ok", call(part, method, args)))
        except Exception as e:
            pipe.send(("error", f"{type(e).__name__}: {e}"))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def worker_main(rank: int, size: int, host: str, port: int, expert_parallel: bool, engine: dict[str, Any],
                threads: int, control: int, device_index: int) -> None:
    from mlc.distributed.state import set_parallel_state

    pipe, config, device = join_group(rank, size, host, port, engine, threads, control, device_index, f"rank{rank}")
    set_parallel_state(rank, size, expert_parallel)

    def call(worker: Worker, method: str, args: tuple[Any, ...]) -> None:
        getattr(worker, method)(*args)  # the driver has the results: nothing goes back

    serve_commands(pipe, lambda: Worker(config, device), call)


if __name__ == "__main__":
    import json
    import sys

    worker_main(**json.loads(sys.argv[1]))
