"""Async API: the engine steps in a background thread; `generate()` yields outputs as they come.

Commands (add, abort) are queued and applied between steps, so an abort frees its pages before the next step.
A consumer that stops iterating (client disconnect, cancellation) aborts its request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator

from mlc.engine.llm_engine import LLMEngine
from mlc.engine.outputs import RequestOutput
from mlc.engine.sampling_params import SamplingParams
from mlc.errors import MlcError

log = logging.getLogger("mlc.engine")


class EngineDeadError(MlcError):
    http_status = 503
    error_type = "engine_error"


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self.error: BaseException | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_event_loop()
        self._thread = threading.Thread(target=self._run, name="mlc-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    # -- requests ----------------------------------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        adapter_id: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped after an internal error: {self.error}")
        rid = request_id or f"req-{next(self._ids)}"
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        self._commands.put(("add", rid, prompt, params or SamplingParams(), adapter_id))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    # -- engine thread -----------------------------------------------------------------------------------------
    def _deliver(self, rid: str, item) -> None:
        q = self._queues.get(rid)
        if q is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(q.put_nowait, item)

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, prompt, params, adapter_id = cmd
                if rid not in self._queues:
                    continue  # the caller went away before its request started
                try:
                    self.engine.add_request(rid, prompt, params, adapter_id)
                except MlcError as e:
                    self._deliver(rid, e)
            else:
                final = self.engine.abort(cmd[1])
                if final is not None:
                    self._deliver(cmd[1], final)  # a consumer still waiting sees the request end

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._apply_commands()
            if not self.engine.has_unfinished():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except MlcError as e:
                self._fail_all(e)
                continue
            except Exception as e:  # a bug: fail every in-flight request loudly rather than hang them
                log.exception("engine step failed")
                self.error = e
                self._fail_all(EngineDeadError(f"internal engine error: {e}"))
                return
            for out in outputs:
                self._deliver(out.request_id, out)

    def _fail_all(self, err: MlcError) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
            self._deliver(rid, err)
