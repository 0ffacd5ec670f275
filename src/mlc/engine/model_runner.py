"""Runs one scheduled step: builds flat inputs and attention metadata, runs the model, returns next-token logits
(and the prompt logprobs the step scored). It reads sequences and never changes them: the scheduler does."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from mlc.engine.isolate import one_by_one
from mlc.engine.page_manager import PageCopy
from mlc.engine.kv_cache import KVCache
from mlc.engine.scheduler import ScheduledSeq
from mlc.layers.attention import build_attention_metadata
from mlc.layers.lora import lora_rows

log = logging.getLogger("mlc.engine")


@dataclass
class StepOutput:
    logits: torch.Tensor  # fp32 [n, vocab]: one row per scheduled sequence the step completes, in order
    prompt_logprobs: dict[int, list[float]] = field(default_factory=dict)  # seq_id -> newly scored prompt tokens
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # what ran (run_isolating may drop some)
    failed: dict[str, Exception] = field(default_factory=dict)  # request id -> why it failed alone


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache):
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device

    def apply_copies(self, copies: list[PageCopy]) -> None:
        ps = self.kv_cache.page_size
        for c in copies:
            src = torch.arange(c.src * ps, c.src * ps + c.num_entries, device=self.device)
            dst = torch.arange(c.dst * ps, c.dst * ps + c.num_entries, device=self.device)
            for layer in self.kv_cache.layers:
                for tensor in layer.values():
                    tensor.copy_slots(src, dst)

    def run_isolating(self, scheduled: list[ScheduledSeq]) -> StepOutput:
        """`run`; if the batch fails, its sequences run one by one so that only the requests that fail alone are
        dropped (in `failed`); a batch in which every sequence fails raises."""
        try:
            return self.run(scheduled)
        except Exception as e:
            if len(scheduled) == 1:
                raise
            log.warning("a step of %d sequences failed (%s); running them one by one", len(scheduled), e)
        alone, failed = one_by_one([s.seq.request_id for s in scheduled], lambda i: self.run([scheduled[i]]))
        kept = [i for i in alone if scheduled[i].seq.request_id not in failed]
        rows = [alone[i].logits for i in kept if scheduled[i].completes]
        scored = {k: v for i in kept for k, v in alone[i].prompt_logprobs.items()}
        logits = torch.cat(rows) if rows else torch.empty(0, 0)
        return StepOutput(logits, scored, [scheduled[i] for i in kept], failed)

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> StepOutput:
        """Logits for each scheduled sequence whose step completes it, and the logprobs of the prompt tokens this
        step scored for sequences that asked for them."""
        ids: list[int] = []
        positions: list[int] = []
        qlens, ctx, tables = [], [], []
        for s in scheduled:
            seq, k = s.seq, s.num_tokens
            ids += seq.all_ids[seq.num_cached : seq.num_cached + k]
            positions += range(seq.num_cached, seq.num_cached + k)
            qlens.append(k)
            ctx.append(seq.num_cache_entries + k)
            tables.append(seq.page_table)
        meta = build_attention_metadata(qlens, ctx, tables, self.kv_cache.page_size, self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        with lora_rows(self._adapter_rows(scheduled, meta.query_start)):
            hidden = self.model(input_ids, pos, meta, self.kv_cache.layers)
        scored = {s.seq.seq_id: self._score_prompt(s, hidden[start : start + s.num_tokens])
                  for s, start in zip(scheduled, meta.query_start) if s.seq.params.prompt_logprobs}
        rows = [r for r, s in zip(meta.last_token_indices(), scheduled) if s.completes]
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]) if rows \
            else hidden.new_empty(0, 0)
        return StepOutput(logits, scored, scheduled)

    def _adapter_rows(self, scheduled: list[ScheduledSeq], starts: list[int]) -> dict:
        """Flat rows of each adapter's tokens this step (a slice when they are contiguous)."""
        rows: dict[int, list[int]] = {}
        for s, start in zip(scheduled, starts):
            if s.seq.adapter_id:
                rows.setdefault(s.seq.adapter_id, []).extend(range(start, start + s.num_tokens))
        out = {}
        for adapter_id, idx in rows.items():
            contiguous = idx == list(range(idx[0], idx[0] + len(idx)))
            out[adapter_id] = slice(idx[0], idx[-1] + 1) if contiguous else torch.tensor(idx, device=self.device)
        return out

    def _score_prompt(self, s: ScheduledSeq, hidden: torch.Tensor) -> list[float]:
        """Logprob of prompt token p+1 from the hidden state at p, for positions not scored before (a sequence
        recomputed after preemption has scored some already)."""
        seq = s.seq
        first = seq.num_cached  # position of hidden[0]
        targets = seq.prompt_ids[first + 1 : first + s.num_tokens + 1]
        skip = len(seq.prompt_logprobs) - first
        if not targets or skip >= len(targets):
            return []
        rows = hidden[max(skip, 0) : len(targets)]
        logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
        want = torch.tensor(targets[max(skip, 0) :], device=logprobs.device)
        return logprobs.gather(1, want[:, None])[:, 0].tolist()
