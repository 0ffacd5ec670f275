"""Runs one scheduled step: builds flat inputs and attention metadata, runs the model, returns next-token logits."""

from __future__ import annotations

import torch

from mlc.engine.block_manager import PageCopy
from mlc.engine.kv_cache import KVCache
from mlc.engine.scheduler import ScheduledSeq
from mlc.layers.attention import build_attention_metadata
from mlc.layers.lora import lora_rows


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

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """fp32 logits `[n, vocab]`, one row for each scheduled sequence whose step completes it, in order.

        Sequences that asked for prompt logprobs get them appended for the prompt tokens this step scored."""
        ids: list[int] = []
        positions: list[int] = []
        qlens, ctx, tables = [], [], []
        for s in scheduled:
            seq, k = s.seq, s.num_tokens
            ids += seq.all_ids[seq.num_cached : seq.num_cached + k]
            positions += range(seq.num_cached, seq.num_cached + k)
            qlens.append(k)
            ctx.append(seq.num_cache_entries + k)
            tables.append(seq.block_table)
        meta = build_attention_metadata(qlens, ctx, tables, self.kv_cache.page_size, self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        with lora_rows(self._adapter_rows(scheduled, meta.query_start)):
            hidden = self.model(input_ids, pos, meta, self.kv_cache.layers)
        for s, start in zip(scheduled, meta.query_start):
            if s.seq.params.prompt_logprobs:
                self._score_prompt(s, hidden[start : start + s.num_tokens])
        rows = [r for r, s in zip(meta.last_token_indices(), scheduled) if s.completes]
        if not rows:
            return hidden.new_empty(0, 0)
        return self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])

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

    def _score_prompt(self, s: ScheduledSeq, hidden: torch.Tensor) -> None:
        """Logprob of prompt token p+1 from the hidden state at p, for positions not scored before (recompute)."""
        seq = s.seq
        first = seq.num_cached  # position of hidden[0]
        targets = seq.prompt_ids[first + 1 : first + s.num_tokens + 1]
        skip = len(seq.prompt_logprobs) - first  # already scored before a preemption
        if not targets or skip >= len(targets):
            return
        rows = hidden[max(skip, 0) : len(targets)]
        logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
        want = torch.tensor(targets[max(skip, 0) :], device=logprobs.device)
        seq.prompt_logprobs += logprobs.gather(1, want[:, None])[:, 0].tolist()
