"""Async API: the engine steps in a background thread; `generate()` yields outputs as they come.

Commands (add, abort) are queued and applied between steps, so an abort frees its pages before the next step.
A consumer that stops iterating (client disconnect, cancellation) aborts its request.

It is also the one client a front end (the HTTP server) uses to reach the engine: tokenizer and chat template,
limits, adapter names, validation, stats, generate and abort. Nothing else of the engine is read from outside.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from mlc.engine.grammar import GrammarSpec
from mlc.engine.kv_transfer import KVHandle, PendingImport
from mlc.engine.llm_engine import LLMEngine
from mlc.engine.lora_manager import AdapterConflictError
from mlc.engine.outputs import EngineStats, RequestOutput
from mlc.engine.sampling_params import SamplingParams
from mlc.engine.sequence import FinishReason
from mlc.errors import EngineDeadError, EngineStepError, InvalidRequestError, MlcError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("mlc.engine")
Delivery = RequestOutput | BaseException  # what a request's queue receives: an output, or why it ended
T = TypeVar("T")
KVPuller = Callable[[PendingImport], "torch.Tensor"]  # a decode instance's transfer (the server's): bytes or raises


class AsyncEngine:
    def __init__(self, engine: LLMEngine, served_name: str | None = None) -> None:
        self._engine = engine
        self.model_name = served_name or engine.model_name  # the name requests use for the base model
        self._queues: dict[str, asyncio.Queue[Delivery]] = {}
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self.error: BaseException | None = None
        self.on_dead: Callable[[EngineDeadError], None] | None = None  # the server drains and exits non-zero
        self._unstarted: dict[str, int] = {}  # request id -> samples, between generate() and the engine taking it
        self._lock = threading.Lock()
        self.kv_puller: KVPuller | None = None  # set by a decode instance's server
        self._pulls: ThreadPoolExecutor | None = None

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
    def tokenizer(self) -> PreTrainedTokenizerBase:
        tokenizer: PreTrainedTokenizerBase = self._engine.tokenizer
        return tokenizer

    @property
    def max_seq_len(self) -> int:
        return self._engine.max_seq_len

    @property
    def max_batch_size(self) -> int:
        return self._engine.max_batch_size

    @property
    def page_size(self) -> int:
        return self._engine.config.page_size

    @property
    def num_pages(self) -> int:
        """KV pages a request can use (the reserved null page not counted)."""
        return self._engine.page_manager.usable_pages

    @property
    def weights(self) -> str:
        """What the weights run as, and why (`describe_weights`)."""
        return self._engine.weights

    @property
    def vocab_size(self) -> int:
        return int(self._engine.model.config.vocab_size)

    @property
    def adapter_names(self) -> list[str]:
        return list(self._engine.adapter_ids)

    def adapter_id(self, name: str | None) -> int:
        """0 for the base model (None or its served name), else a served LoRA adapter's id; 404 otherwise."""
        return 0 if name == self.model_name else self._engine.adapter_id(name)

    def adapters(self) -> list[dict[str, Any]]:
        """The loaded LoRA adapters: name, path, id, rank, pinned, targets, digest, created."""
        return self._engine.loras.describe()

    def evicted_adapter_path(self, name: str) -> str | None:
        """Where an adapter evicted for room (`--max-cpu-loras`) loads from again, if `name` is one."""
        return self._engine.loras.evicted.get(name)

    async def load_lora(self, name: str, path: str, pinned: bool = False, replace: bool = False) -> int:
        """Load an adapter between two steps (streams go on); its id. `replace`: an adapter loaded under `name`
        is swapped for this one, only once this one passed every check (a 409 while requests use the old one)."""
        if name == self.model_name:
            raise InvalidRequestError(f"LoRA adapter name {name!r} is the base model's name; pick another",
                                      field="lora_name")
        if name in self.adapter_names and not replace:  # before reading any file; the engine thread checks again
            raise AdapterConflictError(f"a LoRA adapter named {name!r} is already loaded; unload it first or pick "
                                       "another name", field="lora_name")
        prepared = await asyncio.to_thread(self._engine.prepare_lora, path)  # the files off the engine thread

        def swap() -> int:
            if replace and name in self._engine.adapter_ids:
                self._engine.remove_lora(name)
            return self._engine.add_lora(name, path, pinned, prepared)

        return int(await self.call(swap))

    async def unload_lora(self, name: str) -> None:
        """Unload an adapter between two steps (a 409 while a request uses it)."""
        await self.call(lambda: self._engine.remove_lora(name))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on the engine thread between two steps; its result or its error."""
        if self._thread is None or self._loop is None:
            return fn()
        future: asyncio.Future[Any] = self._loop.create_future()
        self._commands.put(("call", fn, future))
        self._wake.set()
        return await future

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._engine.encode(text, add_special_tokens)

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None,
                    ) -> tuple[str, list[int]]:
        if tools is None and not template_kwargs:
            return self._engine.chat_prompt(messages, add_generation_prompt)
        from mlc.models.tokenizer import render_chat

        text = render_chat(self.tokenizer, messages, add_generation_prompt, tools, template_kwargs)
        return text, self._engine.encode(text, add_special_tokens=False)

    def compile_grammar(self, spec: GrammarSpec) -> None:
        """Compile a structured-output spec now (cached; a 400 naming its field if it cannot be), so that adding
        the request finds it ready: slow for a first grammar, so call it off the event loop."""
        self._engine.compile_grammar(spec)

    def check_token_ids(self, ids: list[int], field: str) -> None:
        self._engine.check_token_ids(ids, field)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._engine.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                                clean_up_tokenization_spaces=False))

    def validate(self, ids: list[int], params: SamplingParams, context: int | None = None,
                 context_source: str = "the context limit") -> None:
        self._engine.validate(ids, params, context, context_source)

    def stats(self) -> EngineStats:
        return self._engine.stats()

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        adapter_id: int = 0,
        validated: bool = False,
        hold_kv: bool = False,
        kv_handle: KVHandle | None = None,
        fair_group: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Queue one request now and return its outputs as they come; `validated`: the caller already ran
        `validate`; `fair_group`: an opaque id the waiting queue takes round-robin. A stream closed before its end
        aborts the request; one never iterated needs `release`.
        `hold_kv` (a prefill instance): the first token only, its pages leased for a decoder (`kv_handle` then).
        `kv_handle` (a decode instance): continue from a prefill instance's pages, pulled by `kv_puller`."""
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._queues:
            raise InvalidRequestError(f"request id {rid!r} is already in use", field="request_id")
        params = params or SamplingParams()
        q: asyncio.Queue[Delivery] = asyncio.Queue()
        self._queues[rid] = q  # before the check below: a dying engine either sees this queue or set its error
        if self.error is not None:
            self._queues.pop(rid, None)
            raise EngineDeadError(f"the engine stopped after an internal error: {self.error}")
        with self._lock:
            self._unstarted[rid] = params.n
        self._commands.put(("add", rid, prompt, params, adapter_id, validated, hold_kv, kv_handle, fair_group))
        self._wake.set()
        return self._outputs(rid, q)

    def submit(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run `fn(engine)` on the engine's thread between steps, from any thread (the KV connector's calls)."""
        fut: Future[T] = Future()
        self._commands.put(("submit", fn, fut))
        self._wake.set()
        return fut

    def _pull(self, rid: str, pending: PendingImport) -> None:
        """Pull a pending import's pages off the engine's thread; the bytes (or None) come back as a command."""
        puller = self.kv_puller

        def run() -> None:
            buf = None
            try:
                if puller is not None:
                    buf = puller(pending)
            except Exception as e:  # the decoder recomputes the prompt: the request is never lost
                log.warning("KV transfer for %s failed (%s: %s); recomputing its prompt", rid, type(e).__name__, e)
            self._commands.put(("kv_done", rid, buf))
            self._wake.set()

        if self._pulls is None:
            self._pulls = ThreadPoolExecutor(4, thread_name_prefix="mlc-kv-pull")
        self._pulls.submit(run)

    async def _outputs(self, rid: str, q: asyncio.Queue[Delivery]) -> AsyncGenerator[RequestOutput, None]:
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
            self.release(rid, finished)

    def release(self, request_id: str, finished: bool = False) -> None:
        """The consumer is gone: drop its queue and, unless its request finished, abort it (idempotent)."""
        if self._queues.pop(request_id, None) is not None and not finished:
            self.abort(request_id)

    def num_waiting(self) -> int:
        """Sequences queued and not yet running: requests not yet handed to the scheduler, then its waiting queue."""
        with self._lock:
            unstarted = sum(self._unstarted.values())
        return unstarted + self._engine.waiting_samples()

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """End a request before its next step (its pages freed); a consumer still reading gets the final output."""
        self._commands.put(("abort", request_id, reason))
        self._wake.set()

    def _deliver(self, rid: str, item: Delivery) -> None:
        q = self._queues.get(rid)
        if q is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(q.put_nowait, item)

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "submit":
                try:
                    cmd[2].set_result(cmd[1](self._engine))
                except Exception as e:
                    cmd[2].set_exception(e)
            elif cmd[0] == "kv_done":
                try:
                    self._deliver_all(self._engine.finish_import(cmd[1], cmd[2]))
                except Exception as e:
                    self._deliver_all(self._engine.fail_requests(e, [cmd[1]]))
            elif cmd[0] == "add":
                _, rid, prompt, params, adapter_id, validated, hold_kv, kv_handle, fair_group = cmd
                with self._lock:
                    self._unstarted.pop(rid, None)
                if rid not in self._queues:
                    continue  # the caller went away before its request started
                try:
                    if hold_kv:
                        self._engine.prefill_for_transfer(rid, prompt, params, adapter_id, validated)
                    elif kv_handle is not None and isinstance(prompt, list):
                        pending = self._engine.begin_import(rid, prompt, params, kv_handle, adapter_id, validated)
                        if pending is not None:
                            self._pull(rid, pending)
                    else:
                        self._engine.add_request(rid, prompt, params, adapter_id, validated, fair_group)
                except MlcError as e:
                    self._deliver(rid, e)
                except Exception as e:  # a bug in admission: this request fails, the engine is checked
                    ended = self._engine.fail_requests(e, [rid])
                    error = ended[0].error if ended else None
                    self._deliver(rid, error or EngineStepError(
                        f"internal engine error admitting this request ({type(e).__name__}: {e}); retry it"))
            elif cmd[0] == "call":
                self._call(cmd[1], cmd[2])
            else:
                try:
                    final: list[RequestOutput | None] = [self._engine.abort(cmd[1], cmd[2])]
                except Exception as e:
                    final = list(self._engine.fail_requests(e, [cmd[1]]))
                self._deliver_all(o for o in final if o is not None)  # a waiting consumer sees the request end
                if final == [None]:
                    self._deliver_lost()

    def _call(self, fn: Callable[[], Any], future: asyncio.Future[Any]) -> None:
        assert self._loop is not None
        try:
            result, error = fn(), None
        except Exception as e:  # the caller's error (a bad adapter): the engine goes on
            result, error = None, e
        self._loop.call_soon_threadsafe(_settle, future, result, error)

    def _run(self) -> None:
        try:
            self._loop_steps()
        except EngineDeadError as e:
            self._die(e)
        except Exception as e:  # a bug outside the supervised step: never leave requests hanging
            log.exception("the engine thread failed")
            self._die(EngineDeadError(f"internal engine error: {e}; the server exits so that its supervisor "
                                      "restarts it"))

    def _loop_steps(self) -> None:
        while not self._stopped.is_set():
            self._apply_commands()
            if not self._engine.has_unfinished():
                self._engine.expire_leases()
                self._wake.wait(0.5)
                self._wake.clear()
                self._engine.check_alive()  # an idle engine still notices a lost worker (/health answers 503)
                continue
            try:
                outputs = self._engine.step()
            except EngineDeadError:
                raise
            except MlcError as e:
                self._fail_all(e)
                continue
            self._deliver_all(outputs)

    def _deliver_all(self, outputs: Iterable[RequestOutput]) -> None:
        failed = False
        for out in outputs:  # a request a failed step ended gets its error (the engine repaired itself)
            self._deliver(out.request_id, out.error if out.error is not None else out)
            failed = failed or out.error is not None
        if failed:
            self._deliver_lost()

    def _deliver_lost(self) -> None:
        """A consumer still waits for a request the engine no longer knows (dropped while it recovered): end it
        with an error. One that already got its final output ignores this."""
        with self._lock:
            unstarted = set(self._unstarted)
        for rid in list(self._queues):
            if not self._engine.has_request(rid) and rid not in unstarted:
                self._deliver(rid, EngineStepError("this request was lost while the engine recovered from an "
                                                   "internal error; retry it"))

    def _die(self, err: EngineDeadError) -> None:
        log.error("%s", err.message)
        self.error = err
        for rid in list(self._queues):
            self._deliver(rid, err)
        if self.on_dead is not None:
            self.on_dead(err)

    def _fail_all(self, err: MlcError) -> None:
        for rid in self._engine.request_ids():
            self._engine.abort(rid)
            self._deliver(rid, err)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
