"""What the server knows about itself: loading/healthy/draining, the engine once loaded, the requests in flight,
and admission (503 while loading or draining, 429 past --max-queue waiting requests).

The model loads in a background thread so the HTTP server answers /health (503 "loading") from the first second.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from mlc.config.serve_config import ServeConfig
from mlc.engine.async_engine import AsyncEngine
from mlc.engine.lora_manager import AdapterConflictError
from mlc.engine.sequence import FinishReason
from mlc.errors import MlcError, ModelNotFoundError, QueueFullError, RequestTooLargeError, ServiceUnavailableError
from mlc.server.input_policy import InputPolicy
from mlc.server.keys import KeyRing
from mlc.server.lora_paths import LoRAPaths
from mlc.server.observability.audit import AuditLog
from mlc.server.observability.hooks import HookRunner, HooksConfig
from mlc.server.observability.metrics import ServerMetrics
from mlc.server.tenants import Tenants
from mlc.server.token_text import TokenText

if TYPE_CHECKING:
    from mlc.engine.llm_engine import LLMEngine
    from mlc.engine.outputs import EngineStats

log = logging.getLogger("mlc.server")

LOADING, HEALTHY, DRAINING, ERROR = "loading", "healthy", "draining", "error"


class InFlight(Protocol):
    """A request the server is running (a `generation.Generation`), as shutdown sees it."""

    def stop(self, reason: FinishReason) -> None: ...


def default_engine_factory(config: ServeConfig) -> LLMEngine:
    from mlc.engine.llm_engine import LLMEngine

    return LLMEngine(config.engine)


class ServerState:
    def __init__(self, config: ServeConfig, hooks: HooksConfig | None = None,
                 engine_factory: Callable[[ServeConfig], Any] = default_engine_factory):
        self.config = config
        self.model_id = config.served_model_name or config.engine.model
        self.status = LOADING
        self.error: str | None = None
        self.exit_code = 0
        self.engine: AsyncEngine | None = None
        self.token_text: TokenText | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.created = int(time.time())
        self.metrics = ServerMetrics(self.model_id)
        self.keys = KeyRing(config.api_keys, config.api_key_file)  # a bad key file fails here, before serving
        self.tenants = Tenants(self.metrics.registry, self.model_id)
        self.policy = InputPolicy(config.strict_input)
        self.audit_log = AuditLog(config.audit_log, config.audit_log_content) if config.audit_log else None
        self.hooks = HookRunner(hooks or HooksConfig())
        self.active: set[InFlight] = set()
        self.on_fatal: Callable[[], None] | None = None  # set by the runner: stop the process
        self.pd: Any = None  # the KV connector's ends (`--kv-role`: server/pd.py's PD) once the engine is loaded
        self.on_ready: list[Callable[[AsyncEngine], None]] = []  # what app.py wires to the loaded engine
        self._engine_factory = engine_factory
        self._mean_latency = 1.0
        self.lora_paths = LoRAPaths(config.lora_dirs, config.allowed_lora_paths)

    # lifecycle
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.hooks.start()
        threading.Thread(target=self._load, name="mlc-load", daemon=True).start()

    def _load(self) -> None:
        t0 = time.monotonic()
        log.info("loading %s", self.config.engine.model)
        try:
            llm = self._engine_factory(self.config)
            if llm.kv_cache.device.type == "cpu":  # RSS after start is the RSS for good, not hours later
                ranks = llm.config.tensor_parallel_size * llm.config.pipeline_parallel_size
                log.info("KV cache pages written once at start: %.0f MiB%s", llm.runner.touch_cache() / 2**20,
                         f" in the driver, and each worker's part in its process ({ranks} ranks)" if ranks > 1 else "")
        except MlcError as e:
            self._fail(e.message, e.exit_code)
            return
        except Exception as e:  # a bug or an unexpected library error: say so, and stop rather than hang at 503
            log.exception("loading the model failed")
            self._fail(f"{type(e).__name__}: {e}", 1)
            return
        engine = AsyncEngine(llm, served_name=self.model_id)
        log.info("loaded %s in %.1fs (context %d tokens, %d KV pages)", self.config.engine.model,
                 time.monotonic() - t0, engine.max_seq_len, engine.num_pages)
        started_loop(self).call_soon_threadsafe(self._ready, engine)

    def _fail(self, message: str, exit_code: int) -> None:
        log.error("cannot serve %s: %s", self.config.engine.model, message)
        self.error, self.exit_code = message, exit_code or 1
        self.status = ERROR
        if self.on_fatal is not None:
            started_loop(self).call_soon_threadsafe(self.on_fatal)

    def _ready(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.token_text = TokenText(self.engine.tokenizer)
        self.engine.on_dead = lambda err: self._fail(err.message, 1)  # exit non-zero: a supervisor restarts us
        self.engine.start(self.loop)
        for hook in self.on_ready:
            hook(engine)
        self.metrics.watch_engine(self.stats, self.waiting, engine.page_size)
        if self.status == LOADING:
            self.status = HEALTHY

    async def drain(self, grace_s: float) -> None:
        """Stop admitting; let in-flight requests finish for `grace_s`, then cancel the rest."""
        self.status = DRAINING
        log.info("shutting down: %d request(s) in flight, %.0fs grace", len(self.active), grace_s)
        deadline = time.monotonic() + grace_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.active:
            log.warning("cancelling %d request(s) still running after %.0fs", len(self.active), grace_s)
            for g in list(self.active):
                g.stop(FinishReason.ABORT)
            deadline = time.monotonic() + 5.0
            while self.active and time.monotonic() < deadline:
                await asyncio.sleep(0.05)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        self.hooks.stop()
        if self.audit_log is not None:
            self.audit_log.close()

    # admission
    def require_engine(self) -> None:
        """503 unless the model is loaded and the server is not shutting down."""
        if self.status == LOADING:
            self.metrics.count_rejected("loading")
            raise ServiceUnavailableError(
                f"the model {self.model_id} is still loading; retry when GET /health answers 200", retry_after=2)
        if self.status == DRAINING:
            self.metrics.count_rejected("draining")
            raise ServiceUnavailableError("the server is shutting down and takes no new requests")
        if self.status == ERROR or self.engine is None or self.engine.error is not None:
            self.metrics.count_rejected("error")
            reason = self.error or (self.engine.error if self.engine else None) or "not ready"
            raise ServiceUnavailableError(f"the engine is not available: {reason}")

    def admit(self, weight: int = 1) -> None:
        """Room for a request of `weight` sequences, or 429: at most max_batch_size + max_queue in flight."""
        self.require_engine()
        engine = loaded_engine(self)
        room = engine.max_batch_size + self.config.max_queue
        if weight > room:
            raise RequestTooLargeError(
                f"n={weight} samples exceed what this server holds at once ({room}: --max-batch-size + "
                "--max-queue); ask for fewer", field="n")
        waiting = self.waiting() + weight
        if waiting > self.config.max_queue:
            self.metrics.count_rejected("queue_full")
            retry = max(1, min(60, math.ceil(self._mean_latency * waiting / engine.max_batch_size)))
            raise QueueFullError(
                f"the server queue is full ({self.waiting()} requests waiting, --max-queue "
                f"{self.config.max_queue}); retry after {retry}s", retry_after=retry)

    def waiting(self) -> int:
        """Sequences admitted and not yet running, as the engine counts them."""
        return self.engine.num_waiting() if self.engine is not None else 0

    def note_latency(self, seconds: float) -> None:
        self._mean_latency = 0.8 * self._mean_latency + 0.2 * seconds

    def stats(self) -> EngineStats | None:
        return self.engine.stats() if self.engine is not None else None

    @staticmethod
    def created_now() -> int:
        return int(time.time())

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:24]}"

    def check_model(self, model: str | None) -> int:
        """The adapter id a request's `model` selects: 0 for the base model, else a served LoRA adapter's."""
        return loaded_engine(self).adapter_id(model)

    async def resolve_model(self, model: str | None) -> int:
        """`check_model`, loading the adapter first where it is not loaded but known: evicted for room, or
        `--lora-dir`/NAME (the resolver)."""
        engine = loaded_engine(self)
        try:
            return engine.adapter_id(model)
        except ModelNotFoundError:
            path = engine.evicted_adapter_path(model) if model else None
            found = self.lora_paths.find(model) if model and path is None else None
            if model is None or (path is None and found is None):
                raise
        try:
            await engine.load_lora(model, path or str(found))
        except AdapterConflictError:
            pass  # another request loaded it meanwhile
        return engine.adapter_id(model)


def started_loop(state: ServerState) -> asyncio.AbstractEventLoop:
    """The server's event loop, once `start` gave it (the loading thread and the requests come after)."""
    if state.loop is None:
        raise RuntimeError("the server state is not started")
    return state.loop


def loaded_engine(state: ServerState) -> AsyncEngine:
    """The engine, where a request got past `require_engine` (once loaded, it stays)."""
    if state.engine is None:
        raise RuntimeError("no engine yet: require_engine() lets no request this far")
    return state.engine


def loaded_token_text(state: ServerState) -> TokenText:
    """The token texts, loaded with the engine (see `loaded_engine`)."""
    if state.token_text is None:
        raise RuntimeError("no engine yet: require_engine() lets no request this far")
    return state.token_text
