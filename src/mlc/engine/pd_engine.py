"""The engine's prefill/decode-disaggregation calls (mixed into `LLMEngine`; the connector is `kv_transfer.py`).

P: `prefill_for_transfer` runs a prompt for its first token and leases its pages; `kv_handle`, `export_kv` and
`release_kv` serve the decode side. D: `begin_import` reserves pages for a prompt P computed (skipping D's own prefix
hits) and says which of P's pages to pull; `finish_import` puts the bytes in place and continues the request from
P's first token, or, with no bytes, recomputes the prompt here. Every call runs on the engine's thread.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from mlc.engine.kv_transfer import KVConnector, KVHandle, PendingImport
from mlc.engine.outputs import RequestOutput
from mlc.engine.sampling_params import SamplingParams
from mlc.engine.sequence import FinishReason, Sequence
from mlc.errors import InvalidRequestError

if TYPE_CHECKING:
    from mlc.engine.output_processor import OutputProcessor
    from mlc.engine.scheduler import Scheduler


class PDMixin:
    kv: KVConnector
    outputs: OutputProcessor
    scheduler: Scheduler
    max_seq_len: int
    prompt_tokens: int
    generation_tokens: int

    if TYPE_CHECKING:  # LLMEngine's
        def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                        adapter_id: int = 0, validated: bool = False) -> None: ...

        def validate(self, ids: list[int], params: SamplingParams, context: int | None = None,
                     context_source: str = "the context limit") -> None: ...

    # P ------------------------------------------------------------------------------------------------------------
    def prefill_for_transfer(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                             adapter_id: int = 0, validated: bool = False) -> None:
        """Queue a prompt for its first token only; when it finishes, its pages stay under a lease and `kv_handle`
        describes them."""
        params = params or SamplingParams()
        self.add_request(request_id, prompt, KVConnector.prefill_params(params), adapter_id, validated)
        if self.kv.exportable:
            self.kv.holding.add(request_id)  # else no lease: the decoder computes the prompt itself

    def kv_handle(self, request_id: str) -> KVHandle | None:
        return self.kv.handle(request_id)

    def export_kv(self, request_id: str, skip_pages: int = 0) -> torch.Tensor:
        return self.kv.export(request_id, skip_pages)

    def release_kv(self, request_id: str) -> bool:
        return self.kv.release(request_id)

    def expire_leases(self) -> list[str]:
        return self.kv.expire() if self.kv.leases else []

    def drop_kv(self, request_id: str) -> None:
        """Before an abort: release the request's lease, and turn a pending import into a request (its pages freed)
        so that the abort ends it with a final output; bytes arriving later are dropped."""
        pending = self.kv.pending.pop(request_id, None)
        if pending is not None:
            self.kv.pages.free(pending.seq)
            self.outputs.add(request_id, pending.seq.prompt_ids, pending.seq.params, pending.seq)
        self.kv.release(request_id)

    # D ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def transferable(params: SamplingParams) -> bool:
        """Requests D can continue from P's first token (the others are computed on D)."""
        return params.n == 1 and params.logprobs is None and not params.prompt_logprobs

    def begin_import(self, request_id: str, prompt_ids: list[int], params: SamplingParams, handle: KVHandle,
                     adapter_id: int = 0, validated: bool = False) -> PendingImport | None:
        """Reserve pages for a prompt P prefilled. Returns what to pull (`src_pages` on P into `dst_pages` here), or
        None when the request was queued to be computed here instead (format mismatch, no free pages, or a request
        the transfer cannot serve)."""
        if request_id in self.outputs.requests or request_id in self.kv.pending:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", field="request_id")
        if not validated:
            self.validate(prompt_ids, params)
        if adapter_id or not self.transferable(params) or not self.kv.exportable:
            self.add_request(request_id, prompt_ids, params, adapter_id, validated=True)
            return None
        seq = Sequence(request_id, list(prompt_ids), params, max_len=self.max_seq_len)
        pending = self.kv.reserve(seq, handle)
        if pending is None:
            self.kv.stats.imports_recomputed += 1
            self.add_request(request_id, prompt_ids, params, validated=True)
        return pending

    def finish_import(self, request_id: str, buf: torch.Tensor | None) -> list[RequestOutput]:
        """The pulled bytes (None: the transfer failed) for a `begin_import`: the request joins the batch, from P's
        first token or, failing that, to be recomputed here. Returns its output so far (empty if it was aborted)."""
        pending = self.kv.complete(request_id, buf)
        if pending is None:
            return []
        seq = pending.seq
        req = self.outputs.add(request_id, seq.prompt_ids, seq.params, seq)
        self.prompt_tokens += len(seq.prompt_ids)
        if not seq.num_cached:
            self.scheduler.add(seq)
            return []
        now = time.monotonic()
        seq.first_scheduled_time = now
        self.scheduler.postprocess([seq], [(pending.handle.first_token, None)], now)
        self.generation_tokens += 1
        if self.outputs.detokenize(seq, self.scheduler.is_stop_token(seq, seq.output_ids[-1])):
            self.scheduler.finish(seq, FinishReason.STOP)
        if not seq.is_finished:
            self.scheduler.add(seq)  # waits holding its pages; admission computes the first token's KV
        return self.outputs.step_outputs([req], now)
