"""One engine request as the server runs it: a deadline, cancellation on shutdown or disconnect, and metrics.

`next()` hands out the engine's outputs. When --request-timeout passes or the server cancels the request at
shutdown, the engine aborts the request with that reason (its pages freed) and its last output carries the rest of
the text with finish_reason "timeout" or "abort", so a client always learns why its text ended. If that happens
before any token, `next()` raises a typed error instead (504 or 503): never an empty 200.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING, NoReturn

from mlc.engine.sampling_params import SamplingParams
from mlc.engine.sequence import FinishReason
from mlc.errors import RequestTimeoutError, ServiceUnavailableError
from mlc.server.pd import exchange_for_generation, finish_prefill
from mlc.server.state import loaded_engine, started_loop

if TYPE_CHECKING:
    from mlc.engine.outputs import RequestOutput
    from mlc.server.state import ServerState
    from mlc.server.tenants import Ticket


ABORT_GRACE_S = 2.0  # a stopped request waits this long for the engine's final output before ending by itself


class Generation:
    def __init__(self, state: ServerState, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 adapter_id: int = 0, ticket: Ticket | None = None):
        self.state = state
        self.ticket = ticket  # the API key's claim (limits, counters), released with the real token count
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.weight = params.n  # sequences it will hold in the batch
        self.start_time = time.monotonic()
        self.first_output_time: float | None = None
        self.last: RequestOutput | None = None
        self.stop_reason: FinishReason | None = None
        self.done = False
        self.closed = False
        self._pending: asyncio.Future | None = None
        self._gave_up = False  # the engine did not answer an abort within ABORT_GRACE_S (a hung step)
        self._give_up_timer: asyncio.TimerHandle | None = None
        self.kv = exchange_for_generation()  # prefill/decode disaggregation (server/pd.py)
        self._gen = loaded_engine(state).generate(
            prompt_ids, params, request_id, adapter_id, validated=True,
            hold_kv=self.kv is not None and self.kv.prefill,
            kv_handle=self.kv.handle_in if self.kv is not None else None,
            fair_group=ticket.name if ticket is not None else None)
        self._timer = started_loop(state).call_later(state.config.request_timeout_s, self.stop, FinishReason.TIMEOUT)
        state.active.add(self)

    @property
    def finish_reason(self) -> str | None:
        return self.last.outputs[0].finish_reason if self.last is not None and self.last.outputs else None

    def stop(self, reason: FinishReason) -> None:
        """End the request early ("timeout", "abort"): the engine aborts it with that reason, and the next `next()`
        returns its final output."""
        if self.done or self.stop_reason is not None:
            return
        self.stop_reason = reason
        loaded_engine(self.state).abort(self.request_id, FinishReason(reason))
        self._give_up_timer = started_loop(self.state).call_later(ABORT_GRACE_S, self._give_up)

    def _give_up(self) -> None:
        if not self.done:
            self._gave_up = True
            if self._pending is not None:
                self._pending.cancel()

    async def next(self) -> RequestOutput | None:
        """The next output, or None once the final one was handed out."""
        if self.done:
            return None
        if self._gave_up:
            return self._end_here()
        self._pending = asyncio.ensure_future(self._gen.__anext__())
        try:
            out = await self._pending
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._gave_up and not (task and task.cancelling()):
                return self._end_here()
            raise
        except StopAsyncIteration:
            self.done = True
            return None
        finally:
            self._pending = None
        if out.finished:
            self.done = True
        if self.stop_reason is not None and self.last is None and not any(o.token_ids for o in out.outputs):
            self._refuse_empty()
        if self.first_output_time is None:
            self.first_output_time = time.monotonic()
        self.last = out
        return out

    def _end_here(self) -> RequestOutput:
        """The engine did not answer the abort in time: end with what was received, never an empty 200."""
        self.done = True
        if self.last is None:
            self._refuse_empty()
        outs = [dataclasses.replace(o, finish_reason=o.finish_reason or self.stop_reason, delta_text="",
                                    delta_token_ids=[], delta_logprobs=[] if o.logprobs is not None else None)
                for o in self.last.outputs]
        self.last = dataclasses.replace(self.last, outputs=outs, finished=True)
        return self.last

    def _refuse_empty(self) -> NoReturn:
        """Stopped before any token: a typed error, never an empty 200."""
        if self.stop_reason == FinishReason.TIMEOUT:
            limit = self.state.config.request_timeout_s
            raise RequestTimeoutError(
                f"no token within --request-timeout ({limit:g}s); the server is busy or the prompt is long: "
                "retry later or raise --request-timeout"
            )
        raise ServiceUnavailableError("the server is shutting down and cancelled this request; retry elsewhere")

    async def close(self) -> None:
        """Release everything (idempotent): abort the engine request if it still runs, record metrics."""
        if self.closed:
            return
        self.closed = True
        if self.ticket is not None:
            self.ticket.release(self.last.num_generated_tokens if self.last is not None else 0)
        self._timer.cancel()
        if self._give_up_timer is not None:
            self._give_up_timer.cancel()
        if self._pending is not None:  # another task is still in next(): let it unwind before closing
            self._pending.cancel()
            await asyncio.wait({self._pending})
        await self._gen.aclose()
        loaded_engine(self.state).release(self.request_id, self.done)
        if self.kv is not None and self.kv.prefill and self.done:
            await finish_prefill(self.state, self.request_id)
        self.state.active.discard(self)
        end = time.monotonic()
        if self.last is not None:
            self.state.metrics.observe(self.last, self.start_time, self.first_output_time, end)
            self.state.note_latency(end - self.start_time)
        reason = self.finish_reason if self.done and self.last is not None else None
        self.state.metrics.count_finished(reason or FinishReason.ABORT)
