"""Continuous batching with chunked prefill under a per-step token budget, and recompute preemption.

Each step first serves running sequences, oldest first (a decode takes one token, a sequence still in prefill takes
the next chunk of its prompt), then admits waiting ones while the batch and the budget allow. When pages run out, the
newest running sequence is preempted: its pages are freed and it waits at the front of the queue to be recomputed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mlc.engine.block_manager import BlockManager, PageCopy
from mlc.engine.sequence import Sequence, Status


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # new tokens run through the model this step

    @property
    def completes(self) -> bool:
        """After this step the sequence's KV covers all its tokens, so its next token is sampled."""
        return self.seq.num_cached + self.num_tokens == len(self.seq)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[PageCopy] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_batch_size: int = 8,
        max_num_batched_tokens: int = 512,
        enable_chunked_prefill: bool = True,
    ):
        self.bm = block_manager
        self.max_batch_size = max_batch_size
        self.budget = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sample joins the batch directly (its pages are shared with its parent)."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.budget
        chosen: set[int] = set()
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.seq_id in {s.seq_id for s in out.preempted}:
                continue
            k = self._chunk(seq, budget, bool(out.scheduled))
            if k == 0:
                continue
            if not self._make_room(seq, k, chosen, out):
                continue
            out.copies += self.bm.grow(seq, seq.num_cache_entries + k)
            out.scheduled.append(ScheduledSeq(seq, k))
            chosen.add(seq.seq_id)
            budget -= k
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _chunk(self, seq: Sequence, budget: int, batch_nonempty: bool) -> int:
        need = seq.num_uncomputed
        if self.chunked:
            return min(need, budget)
        return need if need <= budget or not batch_nonempty else 0

    def _make_room(self, seq: Sequence, k: int, chosen: set[int], out: SchedulerOutput) -> bool:
        while not self.bm.can_grow(seq, seq.num_cache_entries + k):
            victims = [s for s in self.running if s.seq_id not in chosen and s is not seq]
            victim = victims[-1] if victims else seq
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if not seq.block_table:
                self.bm.match_prefix(seq)
            k = self._chunk(seq, budget, bool(out.scheduled))
            if k == 0 or not self._fits(seq, seq.num_cache_entries + k):
                self.bm.free(seq)  # let go of prefix pages it matched; it retries next step
                break
            self.waiting.popleft()
            out.copies += self.bm.grow(seq, seq.num_cache_entries + k)
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, k))
            budget -= k

    def _fits(self, seq: Sequence, num_entries: int) -> bool:
        """Admission keeps a small reserve of pages so running sequences can keep decoding."""
        if not self.bm.can_grow(seq, num_entries):
            return False
        if not self.running:
            return True
        need = self.bm.pages_for(num_entries) - len(seq.block_table)
        reserve = min(len(self.running), max(1, self.bm.usable_pages // 100))
        return need + reserve <= self.bm.num_free_pages

    def preempt(self, seq: Sequence) -> None:
        self.bm.free(seq)
        self.running.remove(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence, wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
