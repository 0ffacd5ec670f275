"""What happens when a step fails: the requests that step touched fail, the engine's state is audited and, if the
accounting is in doubt, rebuilt (every page freed, every live sequence recomputed), and the engine goes on.

The engine is declared dead only when the audit still fails after a rebuild, or when steps keep failing with no
success between them (a broken device or model, not one bad request); the server then drains and exits non-zero so
that a supervisor restarts it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from mlc.engine.sequence import FinishReason
from mlc.errors import EngineDeadError, EngineStepError

if TYPE_CHECKING:
    from mlc.engine.llm_engine import LLMEngine
    from mlc.engine.outputs import RequestOutput

log = logging.getLogger("mlc.engine")

MAX_CONSECUTIVE_FAILURES = 3


def live_sequences(engine: LLMEngine) -> list:
    return [s for req in engine.requests.values() for s in req.seqs if not s.is_finished]


def audit(engine: LLMEngine) -> list[str]:
    """Every inconsistency between requests, queues and pages; empty when the engine is sound."""
    live = live_sequences(engine)
    return engine.scheduler.audit(live) + engine.page_manager.audit(live)


def rebuild(engine: LLMEngine) -> None:
    """Forget all pages and the prefix cache; every live sequence waits to be recomputed from its tokens."""
    engine.page_manager.reset()
    engine.kv_cache.clear_null_page()
    engine.scheduler.requeue_all(live_sequences(engine))


def recover(engine: LLMEngine, error: Exception, request_ids: list[str]) -> list[RequestOutput]:
    """End `request_ids` with `finish_reason` "error", repair the engine, and return their final outputs, each
    carrying an `EngineStepError`; raise `EngineDeadError` when the engine is beyond repair."""
    log.error("engine step failed (%s: %s); failing %d request(s)", type(error).__name__, error, len(request_ids),
              exc_info=error)
    err = EngineStepError(
        f"internal engine error while running this request ({type(error).__name__}: {error}); the engine recovered "
        "and keeps serving other requests; if this request fails again, report it with its request id")
    outputs = []
    for rid in request_ids:
        try:
            out = engine.abort(rid, FinishReason.ERROR)
        except Exception:  # the accounting is already broken; the rebuild below sorts it out
            engine.forget(rid)
            continue
        if out is not None:
            out.error = err
            outputs.append(out)
    problems = audit(engine)
    if problems:
        log.error("engine state inconsistent after the failure (%s); rebuilding it", "; ".join(problems[:5]))
        rebuild(engine)
        problems = audit(engine)
    if problems:
        raise EngineDeadError(f"the engine's state could not be repaired after an internal error ({error}): "
                              f"{problems[0]}; the server exits so that its supervisor restarts it")
    if engine.consecutive_failures >= MAX_CONSECUTIVE_FAILURES and len(engine.failed_prompts) > 1:
        raise EngineDeadError(f"{engine.consecutive_failures} engine steps failed in a row on different prompts, the "
                              f"last with {error}; the model or device is broken, so the server exits so that its "
                              "supervisor restarts it")
    return outputs
