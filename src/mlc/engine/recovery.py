"""What happens when a step fails: the requests that step touched fail, the engine's state is audited and, if the
accounting is in doubt, rebuilt (every page freed, every live sequence recomputed), and the engine goes on.

The engine is declared dead only when the audit still fails after a rebuild, or when steps keep failing with no
success between them (a broken device or model, not one bad request); the server then drains and exits non-zero so
that a supervisor restarts it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from mlc.engine.kv_cache import KVCache
from mlc.engine.kv_transfer import KVConnector
from mlc.engine.output_processor import OutputProcessor
from mlc.engine.outputs import RequestOutput
from mlc.engine.page_manager import PageManager
from mlc.engine.scheduler import Scheduler
from mlc.engine.sequence import FinishReason
from mlc.engine.sequence import Sequence as Seq
from mlc.errors import EngineDeadError, EngineStepError

log = logging.getLogger("mlc.engine")

MAX_CONSECUTIVE_FAILURES = 3

EndRequest = Callable[[str, FinishReason], RequestOutput | None]


class Recovery:
    """The engine's health: failed steps in a row (and the prompts they held), audits and rebuilds. Failing requests
    takes `end_request`, which ends one request and returns its final output (the engine's abort), per call: held
    here, it would tie the engine into a reference cycle, and a tensor-parallel engine let go would keep its
    workers until the garbage collector ran."""

    def __init__(self, scheduler: Scheduler, pages: PageManager, kv_cache: KVCache, requests: OutputProcessor,
                 connector: KVConnector | None = None):
        self.scheduler, self.pages, self.kv_cache, self.requests = scheduler, pages, kv_cache, requests
        self.connector = connector  # KV leases and imports hold pages outside the scheduler
        self.consecutive_failures = 0  # steps failed since the last good one
        self.failed_prompts: set[int] = set()  # the prompts those steps held

    def audit(self) -> list[str]:
        """Every inconsistency between requests, queues and pages; empty when the engine is sound."""
        live = self.requests.live_sequences()
        holders = self.connector.holders() if self.connector is not None else []
        return self.scheduler.audit(live) + self.pages.audit(live + holders)

    def rebuild(self) -> None:
        """Forget all pages and the prefix cache; every live sequence waits to be recomputed from its tokens."""
        self.pages.reset()
        self.kv_cache.clear_null_page()
        if self.connector is not None:
            self.connector.reset()
        self.scheduler.requeue_all(self.requests.live_sequences())

    def step_succeeded(self) -> None:
        self.consecutive_failures = 0
        self.failed_prompts.clear()

    def step_failed(self, error: Exception, seqs: Sequence[Seq], end_request: EndRequest) -> list[RequestOutput]:
        """A whole step failed: count it (with the prompts it held, so that one poison prompt sent again and again
        is not mistaken for a broken model) and end its requests."""
        self.consecutive_failures += 1
        rids = list(dict.fromkeys(s.request_id for s in seqs if s.request_id in self.requests.requests))
        self.failed_prompts.update(hash(tuple(self.requests.requests[r].prompt_ids)) for r in rids)
        return self.fail(error, rids, end_request)

    def fail(self, error: Exception, request_ids: list[str], end_request: EndRequest) -> list[RequestOutput]:
        """End `request_ids` with `finish_reason` "error", repair the engine, and return their final outputs, each
        carrying an `EngineStepError`; raise `EngineDeadError` when the engine is beyond repair."""
        log.error("engine step failed (%s: %s); failing %d request(s)", type(error).__name__, error,
                  len(request_ids), exc_info=error)
        err = EngineStepError(
            f"internal engine error while running this request ({type(error).__name__}: {error}); the engine "
            "recovered and keeps serving other requests; if this request fails again, report it with its request id")
        outputs = []
        for rid in request_ids:
            try:
                out = end_request(rid, FinishReason.ERROR)
            except Exception:  # the accounting is already broken; the rebuild below sorts it out
                req = self.requests.requests.get(rid)
                if req is not None:
                    self.requests.forget(req)
                continue
            if out is not None:
                out.error = err
                outputs.append(out)
        self._repair(error)
        return outputs

    def _repair(self, error: Exception) -> None:
        problems = self.audit()
        if problems:
            log.error("engine state inconsistent after the failure (%s); rebuilding it", "; ".join(problems[:5]))
            self.rebuild()
            problems = self.audit()
        if problems:
            raise EngineDeadError(f"the engine's state could not be repaired after an internal error ({error}): "
                                  f"{problems[0]}; the server exits so that its supervisor restarts it")
        if self.consecutive_failures >= MAX_CONSECUTIVE_FAILURES and len(self.failed_prompts) > 1:
            raise EngineDeadError(f"{self.consecutive_failures} engine steps failed in a row on different prompts, "
                                  f"the last with {error}; the model or device is broken, so the server exits so "
                                  "that its supervisor restarts it")
