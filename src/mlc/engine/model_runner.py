"""Runs one scheduled step: builds flat inputs and attention metadata, runs the model, returns next-token logits
(and the prompt logprobs the step scored). It reads sequences and never changes them: the scheduler does."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mlc.distributed.state import parallel_scope, parallel_state
from mlc.engine.isolate import one_by_one
from mlc.engine.kv_cache import KVCache
from mlc.engine.page_manager import PageCopy
from mlc.engine.sequence import ScheduledSeq
from mlc.errors import EngineDeadError
from mlc.layers.attention import build_attention_metadata
from mlc.layers.lora import (
    LoRAAdapter,
    PreparedAdapter,
    attach_adapter,
    detach_adapter,
    install_adapter,
    lora_rows,
    prepare_adapter,
)
from mlc.models.base import CausalLM
from mlc.models.mtp import mtp_hidden

log = logging.getLogger("mlc.engine")


@dataclass
class StepOutput:
    logits: torch.Tensor  # fp32 [n, vocab]: one row per scheduled sequence the step completes, in order
    prompt_logprobs: dict[int, list[float]] = field(default_factory=dict)  # seq_id -> newly scored prompt tokens
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # what ran (run_isolating may drop some)
    failed: dict[str, Exception] = field(default_factory=dict)  # request id -> why it failed alone
    hidden: torch.Tensor | None = None  # the final hidden states of every row, where the model has an MTP layer


@dataclass
class MtpRows:
    """One sequence's share of the pass of the MTP layer (models/mtp.py) after a step: the trunk's hidden states
    at positions `start` .. `start + len(tokens) - 1` (step rows from `row`), each beside the token after it."""

    row: int
    start: int
    tokens: list[int]
    page_table: list[int]
    draft: bool  # score the last row: the sequence wants the layer's token


@dataclass
class StepInputs:
    """What one step runs, as plain data: the driver builds it from the scheduled sequences, and under tensor
    parallelism every rank executes the same one."""

    ids: list[int]
    positions: list[int]
    query_lens: list[int]
    context_lens: list[int]
    page_tables: list[list[int]]
    adapter_rows: dict[int, list[int]]  # adapter id -> flat rows of its tokens
    score: list[tuple[int, int, list[int], int]]  # (seq_id, first row, prompt targets, already scored) to score
    logit_rows: list[int]  # flat rows whose next-token logits the step returns (sequences it completes)
    generating: list[bool] = field(default_factory=list)  # per sequence: its new tokens follow the whole prompt


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device
        self.parallel = parallel_state()  # the state the model was built under; every call runs under it again
        self.keep_hidden = False  # StepOutput.hidden: the engine drafts with the model's MTP layer
        # the model's own cache layers come first; an MTP layer's or a draft model's follow them
        self.model_layers = len(model.stage_cache_spec()) - (model.mtp is not None)
        if self.device.type == "cpu":  # build (first run on this machine) or load the kernel now, not mid-step
            from mlc.layers.cpu_kernels import kernel_status

            log.info("CPU kernels: %s", kernel_status())

    def touch_cache(self) -> int:
        """Write every KV page once (`KVCache.touch`), on every rank that holds a part of the cache; the bytes of
        this rank's part."""
        return self.kv_cache.touch()

    def apply_copies(self, copies: list[PageCopy]) -> None:
        ps = self.kv_cache.page_size
        for c in copies:
            self.kv_cache.move_slots(torch.arange(c.src * ps, c.src * ps + c.num_entries),
                                     torch.arange(c.dst * ps, c.dst * ps + c.num_entries))

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """KV entries from slots `src` to `dst` (sparse-KV compaction comes through here too)."""
        self.kv_cache.move_slots(src, dst)

    def run_isolating(self, scheduled: list[ScheduledSeq]) -> StepOutput:
        """`run`; if the batch fails, its sequences run one by one so that only the requests that fail alone are
        dropped (in `failed`); a batch in which every sequence fails raises."""
        try:
            return self.run(scheduled)
        except EngineDeadError:
            raise  # a tensor-parallel worker is gone: running alone cannot help
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

    def run(self, scheduled: list[ScheduledSeq]) -> StepOutput:
        """Logits for each scheduled sequence whose step completes it, and the logprobs of the prompt tokens this
        step scored for sequences that asked for them."""
        with parallel_scope(self.parallel):
            step = prepare_step(scheduled)
            if not self.keep_hidden:
                return StepOutput(*self.execute(step), scheduled)  # under tensor parallelism, on every rank
            hidden = self.hidden_states(step)  # the MTP layer reads them after the step (one process only)
            logits, scored = self.outputs(step, hidden)
        return StepOutput(logits, scored, scheduled, hidden=hidden)

    @torch.inference_mode()
    def run_mtp(self, hidden: torch.Tensor, jobs: list[MtpRows]) -> tuple[list[int | None], list[torch.Tensor | None]]:
        """The MTP layer over each job's rows (the hidden states before them: `hidden` rows from `row`), filling its
        slots of the layer's cache; for each job that wants a draft, the greedy token of its last row and that row's
        output, which a further draft reads as its hidden state (`models/mtp.py`)."""
        if not jobs:
            return [], []
        dev = self.device
        rows = torch.cat([torch.arange(j.row, j.row + len(j.tokens)) for j in jobs]).to(dev)
        ids = torch.tensor([t for j in jobs for t in j.tokens], dtype=torch.long, device=dev)
        pos = torch.tensor([p for j in jobs for p in range(j.start + 1, j.start + 1 + len(j.tokens))], device=dev)
        meta = build_attention_metadata([len(j.tokens) for j in jobs], [j.start + len(j.tokens) for j in jobs],
                                        [j.page_table for j in jobs], self.kv_cache.page_size, dev)
        with parallel_scope(self.parallel):
            out = mtp_hidden(self.model, ids, pos, hidden[rows], meta, self.kv_cache.layers[self.model_layers])
            ends = list(itertools.accumulate(len(j.tokens) for j in jobs))
            want = [ends[i] - 1 for i, j in enumerate(jobs) if j.draft]
            tokens = iter(self.model.compute_logits(out[want]).argmax(-1).tolist() if want else [])
        lasts = iter(want)
        drafts = [next(tokens) if j.draft else None for j in jobs]
        outs = [out[next(lasts)] if j.draft else None for j in jobs]
        return drafts, outs

    def attach_adapter(self, adapter_id: int, name: str, path: str, max_rank: int | None = None,
                       prepared: PreparedAdapter | None = None) -> LoRAAdapter:
        with parallel_scope(self.parallel):
            if prepared is not None:
                return install_adapter(self.model, adapter_id, name, prepared)
            return attach_adapter(self.model, adapter_id, name, Path(path), max_rank)

    def prepare_adapter(self, path: str, max_rank: int | None = None) -> PreparedAdapter | None:
        """The adapter read and checked, from any thread (None where every rank must read it itself)."""
        with parallel_scope(self.parallel):
            return prepare_adapter(self.model, Path(path), max_rank)

    def detach_adapter(self, adapter_id: int) -> None:
        detach_adapter(self.model, adapter_id)

    @torch.inference_mode()
    def execute(self, step: StepInputs) -> tuple[torch.Tensor, dict[int, list[float]]]:
        return self.outputs(step, self.hidden_states(step))

    @torch.inference_mode()
    def hidden_states(self, step: StepInputs) -> torch.Tensor:
        """The model's output for the step's tokens (a pipeline stage's: what its last layer leaves)."""
        meta = build_attention_metadata(step.query_lens, step.context_lens, step.page_tables, self.kv_cache.page_size,
                                        self.device, generating=step.generating)
        input_ids = torch.tensor(step.ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(step.positions, dtype=torch.long, device=self.device)
        with lora_rows(self._adapter_rows(step.adapter_rows)):
            hidden: torch.Tensor = self.model(input_ids, pos, meta, self.kv_cache.layers[: self.model_layers])
        return hidden

    @torch.inference_mode()
    def outputs(self, step: StepInputs, hidden: torch.Tensor) -> tuple[torch.Tensor, dict[int, list[float]]]:
        """The step's next-token logits and the prompt logprobs it scored, from the final hidden states."""
        scored = {seq_id: self._score_prompt(hidden, start, targets, skip)
                  for seq_id, start, targets, skip in step.score}
        rows = step.logit_rows
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]) if rows \
            else hidden.new_empty(0, 0)
        return logits, scored

    def _adapter_rows(self, rows: dict[int, list[int]]) -> dict[int, slice | torch.Tensor]:
        """Each adapter's rows as a slice when they are contiguous, else an index tensor."""
        out: dict[int, slice | torch.Tensor] = {}
        for adapter_id, idx in rows.items():
            contiguous = idx == list(range(idx[0], idx[0] + len(idx)))
            out[adapter_id] = slice(idx[0], idx[-1] + 1) if contiguous else torch.tensor(idx, device=self.device)
        return out

    def _score_prompt(self, hidden: torch.Tensor, start: int, targets: list[int], skip: int) -> list[float]:
        if not targets:
            return []
        rows = hidden[start + max(skip, 0) : start + len(targets)]
        logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
        want = torch.tensor(targets[max(skip, 0) :], device=logprobs.device)
        return logprobs.gather(1, want[:, None])[:, 0].tolist()


def prepare_step(scheduled: list[ScheduledSeq]) -> StepInputs:
    """The step's flat inputs from the scheduled sequences (read, never changed)."""
    step = StepInputs([], [], [], [], [], {}, [], [])
    row = 0
    for s in scheduled:
        if s.num_draft:
            row = _verify_rows(step, s, row)
            continue
        seq, k = s.seq, s.num_tokens
        step.ids += seq.all_ids[seq.num_cached : seq.num_cached + k]
        step.positions += range(seq.num_cached, seq.num_cached + k)
        step.query_lens.append(k)
        step.generating.append(seq.num_cached >= len(seq.prompt_ids))
        step.context_lens.append(seq.num_cache_entries + k)
        step.page_tables.append(seq.page_table)  # read now (and pickled at once for other ranks), not kept
        if seq.adapter_id:
            step.adapter_rows.setdefault(seq.adapter_id, []).extend(range(row, row + k))
        if seq.params.prompt_logprobs:
            # logprob of prompt token p+1 from the hidden state at p, for positions not scored before (a sequence
            # recomputed after preemption has scored some already)
            first = seq.num_cached
            targets = seq.prompt_ids[first + 1 : first + k + 1]
            skip = len(seq.prompt_logprobs) - first
            if targets and skip < len(targets):
                step.score.append((seq.seq_id, row, targets, skip))
            else:
                step.score.append((seq.seq_id, row, [], 0))
        if s.completes:
            step.logit_rows.append(row + k - 1)
        row += k
    return step


def _verify_rows(step: StepInputs, s: ScheduledSeq, row: int) -> int:
    """A decoding sequence's next token and its drafts, each a decode row of its own over the same page table with
    one more token of context than the row before: the rows compute exactly what one-token steps would (the
    batch-invariant decode path), and each returns its logits. Returns the next free row."""
    seq = s.seq
    ids = [*seq.all_ids[seq.num_cached :], *seq.draft_ids[: s.num_draft]]
    for j, token in enumerate(ids):
        step.ids.append(token)
        step.positions.append(seq.num_cached + j)
        step.query_lens.append(1)
        step.generating.append(True)
        step.context_lens.append(seq.num_cache_entries + j + 1)
        step.page_tables.append(seq.page_table)
        step.logit_rows.append(row + j)
    if seq.adapter_id:
        step.adapter_rows.setdefault(seq.adapter_id, []).extend(range(row, row + len(ids)))
    if seq.params.prompt_logprobs:
        step.score.append((seq.seq_id, row, [], 0))
    return row + len(ids)
