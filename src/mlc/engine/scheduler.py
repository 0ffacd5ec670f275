"""Continuous batching with chunked prefill under a per-step token budget, and recompute preemption; and the
update of sequences after each step (the scheduler is the one owner of a sequence's progress and of its pages).

Each step first serves running sequences, oldest first (a decode takes one token, a sequence still in prefill takes
the next chunk of its prompt), then admits waiting ones while the batch and the budget allow. When pages run out, the
newest running sequence is preempted: its pages are freed and it waits at the front of the queue to be recomputed.

After the model ran: `advance` moves the cached counts and registers full pages with the prefix cache, `fork` starts
the other samples of a prompt, `compact` thins sparse KV, and `postprocess` appends sampled tokens (moving a
structured output's matcher on) and ends sequences on a stop token, EOS or their length, freeing their pages.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from mlc.engine.grammar import advance as advance_grammar
from mlc.engine.page_manager import PageCopy, PageManager
from mlc.engine.sequence import FinishReason, ScheduledSeq, Sequence, Status, TokenLogprob
from mlc.engine.sparse_kv import SparseKV


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
        page_manager: PageManager,
        max_batch_size: int = 8,
        max_num_batched_tokens: int = 512,
        enable_chunked_prefill: bool = True,
        eos_token_ids: set[int] | None = None,
        sparse: SparseKV | None = None,
        max_loras: int | None = None,
    ):
        self.pages = page_manager
        self.eos_token_ids = set(eos_token_ids or ())
        self.sparse = sparse
        self.max_batch_size = max_batch_size
        self.budget = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.on_finish: Callable[[Sequence], None] | None = None  # sees a finished sequence before its pages go
        self.max_loras = max_loras  # distinct LoRA adapters in one batch; None: no bound
        self._grouped = False  # a sequence with a fairness group was queued: order the queue round-robin

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        if seq.fair_group is None and not self._grouped:
            self.waiting.append(seq)
            return
        self._grouped = True
        self.waiting.insert(self._fair_position(seq.fair_group), seq)

    def _fair_position(self, group: str | None) -> int:
        """Round-robin across fairness groups (opaque ids the caller gives, e.g. one per API key): a new sequence's
        round is how many of its group already wait; it goes before the first waiting sequence of a later round, so
        a group that queued a burst cannot hold back another group's first sequence."""
        mine = sum(1 for s in self.waiting if s.fair_group == group)
        seen: dict[str | None, int] = {}
        for i, s in enumerate(self.waiting):
            r = seen[s.fair_group] = seen.get(s.fair_group, -1) + 1
            if r > mine:
                return i
        return len(self.waiting)

    def add_running(self, seq: Sequence) -> None:
        """A forked sample joins the batch directly (its pages are shared with its parent)."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def schedule(self, in_flight: frozenset[int] = frozenset(), max_seqs: int | None = None) -> SchedulerOutput:
        """The next step. Under pipeline parallelism `in_flight` are the sequences whose earlier step has not come
        back (skipped, and never preempted), and `max_seqs` caps the step's sequences (one micro-batch)."""
        out = SchedulerOutput()
        budget = self.budget
        chosen: set[int] = set(in_flight)
        most = max_seqs or 1 << 30
        for seq in list(self.running):
            if budget <= 0 or len(out.scheduled) >= most:
                break
            if seq.seq_id in in_flight or seq.seq_id in {s.seq_id for s in out.preempted}:
                continue
            k = self._chunk(seq, budget, bool(out.scheduled))
            if k == 0:
                continue
            if not self._make_room(seq, k, chosen, out):
                continue
            out.copies += self.pages.grow(seq, seq.num_cache_entries + k)
            out.scheduled.append(ScheduledSeq(seq, k))
            chosen.add(seq.seq_id)
            budget -= k
        if not out.preempted:
            budget = self._admit(out, budget, most)
        self._add_drafts(out, budget)
        return out

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Speculative tokens ride on what the step has left once every running sequence and every admission has
        its share: the budget and the free pages (they never preempt or hold back anyone); the rest are dropped."""
        for i, item in enumerate(out.scheduled):
            seq = item.seq
            if not seq.draft_ids:
                continue
            d = self._drafts(seq, item.num_tokens, budget)
            if d:
                out.copies += self.pages.grow(seq, seq.num_cache_entries + item.num_tokens + d)
                out.scheduled[i] = ScheduledSeq(seq, item.num_tokens + d, d)
                budget -= d

    def _chunk(self, seq: Sequence, budget: int, batch_nonempty: bool) -> int:
        need = seq.num_uncomputed
        if self.chunked:
            return min(need, budget)
        return need if need <= budget or not batch_nonempty else 0

    def _drafts(self, seq: Sequence, k: int, budget: int) -> int:
        """How many of the sequence's draft tokens fit the budget and the free pages beside its `k` tokens."""
        d = min(len(seq.draft_ids), budget) if k == seq.num_uncomputed == 1 else 0
        while d and not self.pages.can_grow(seq, seq.num_cache_entries + k + d):
            d //= 2
        del seq.draft_ids[d:]
        return d

    def _make_room(self, seq: Sequence, k: int, chosen: set[int], out: SchedulerOutput) -> bool:
        while not self.pages.can_grow(seq, seq.num_cache_entries + k):
            victims = [s for s in self.running if s.seq_id not in chosen and s is not seq]
            victim = victims[-1] if victims else seq
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, out: SchedulerOutput, budget: int, most: int = 1 << 30) -> int:
        """Admit waiting sequences while the batch, the budget and the pages allow (and at most `most` sequences
        scheduled: a pipeline's micro-batch share); returns the budget left. A sequence whose adapter would take
        the batch past `max_loras` adapters is held back (in its place) while the ones behind it may go."""
        held: list[Sequence] = []
        adapters = {s.adapter_id for s in self.running if s.adapter_id}
        while (self.waiting and budget > 0 and len(self.running) < self.max_batch_size
               and len(out.scheduled) < most):
            seq = self.waiting[0]
            if self.max_loras and seq.adapter_id and seq.adapter_id not in adapters \
                    and len(adapters) >= self.max_loras:
                held.append(self.waiting.popleft())
                continue
            if not seq.page_table:
                self.pages.match_prefix(seq)
            k = self._chunk(seq, budget, bool(out.scheduled))
            if k == 0 or not self._fits(seq, seq.num_cache_entries + k):
                self.pages.free(seq)  # let go of prefix pages it matched; it retries next step
                break
            self.waiting.popleft()
            out.copies += self.pages.grow(seq, seq.num_cache_entries + k)
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, k))
            budget -= k
            if seq.adapter_id:
                adapters.add(seq.adapter_id)
        self.waiting.extendleft(reversed(held))
        return budget

    def adapter_users(self, adapter_id: int) -> int:
        """Running and waiting sequences that use the adapter."""
        return sum(s.adapter_id == adapter_id for s in (*self.running, *self.waiting))

    def _fits(self, seq: Sequence, num_entries: int) -> bool:
        """Admission keeps a small reserve of pages so running sequences can keep decoding."""
        if not self.pages.can_grow(seq, num_entries):
            return False
        if not self.running:
            return True
        need = self.pages.pages_for(num_entries) - len(seq.page_table)
        reserve = min(len(self.running), max(1, self.pages.usable_pages // 100))
        return need + reserve <= self.pages.num_free_pages

    def preempt(self, seq: Sequence) -> None:
        self.pages.free(seq)
        seq.draft_ids = []
        self.running.remove(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def audit(self, live: list[Sequence]) -> list[str]:
        """What is wrong with the queues, given every unfinished sequence the engine knows (empty: consistent)."""
        problems: list[str] = []
        running, waiting = {s.seq_id for s in self.running}, {s.seq_id for s in self.waiting}
        if len(running) != len(self.running) or len(waiting) != len(self.waiting) or running & waiting:
            problems.append("a sequence is queued twice")
        for seq in live:
            queue = Status.RUNNING if seq.seq_id in running else Status.WAITING if seq.seq_id in waiting else None
            if queue is None or seq.status is not queue:
                problems.append(f"sequence {seq.seq_id} is {seq.status.value} but queued as {queue}")
            if not 0 <= seq.num_cached <= len(seq) or seq.num_cache_entries > seq.num_cached:
                problems.append(f"sequence {seq.seq_id} caches {seq.num_cached} of {len(seq)} tokens")
        if len(running) + len(waiting) != len(live):
            problems.append(f"{len(running) + len(waiting)} sequences queued, {len(live)} unfinished")
        return problems

    def requeue_all(self, seqs: list[Sequence]) -> None:
        """Put these sequences, and only these, back in the waiting queue to be recomputed (after a reset)."""
        self.running = []
        self.waiting = deque(sorted(seqs, key=lambda s: (s.arrival_time, s.sample_index)))
        for seq in self.waiting:
            seq.status = Status.WAITING
            seq.page_table, seq.page_hashes, seq.kv_positions = [], [], None
            seq.num_cached = seq.num_cache_entries = 0

    def finish(self, seq: Sequence, reason: FinishReason | None = None) -> None:
        """End a sequence (or, with no reason, release one already ended), wherever it is; frees its pages."""
        if reason is not None:
            seq.finish(reason)
            if self.on_finish is not None:
                self.on_finish(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pages.free(seq)

    def advance(self, scheduled: list[ScheduledSeq], prompt_logprobs: dict[int, list[float]],
                now: float) -> list[Sequence]:
        """The step's tokens are in the cache: move the counts on; returns the sequences whose next token is due."""
        due = [s.seq for s in scheduled if s.completes]
        for item in scheduled:
            seq = item.seq
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            seq.num_cached += item.num_tokens - item.num_draft  # drafts count once accepted (`accept`)
            seq.num_cache_entries += item.num_tokens - item.num_draft
            seq.prompt_logprobs += prompt_logprobs.get(seq.seq_id, [])
            self.pages.register_full_pages(seq)
        return due

    def accept(self, seq: Sequence, num_accepted: int) -> None:
        """Verification kept the first `num_accepted` of the sequence's drafts (now in `output_ids`): their KV
        counts as cached, and the pages only rejected drafts reached are released, so nothing unaccepted ever
        enters the prefix cache."""
        seq.draft_ids = []
        if seq.is_finished:
            return  # ended inside the run (stop token, stop string, length): its pages are gone already
        seq.num_cached += num_accepted
        self.pages.shrink(seq, seq.num_cache_entries + num_accepted)
        self.pages.register_full_pages(seq)

    def fork(self, parent: Sequence, num: int) -> list[Sequence]:
        """`num` more samples of `parent`'s prompt, sharing its pages, join the batch."""
        children = []
        for j in range(1, num + 1):
            child = Sequence(parent.request_id, parent.prompt_ids, parent.params, adapter_id=parent.adapter_id,
                             sample_index=j, max_len=parent.max_len, arrival_time=parent.arrival_time,
                             grammar=parent.grammar, adapter_key=parent.adapter_key)
            child.first_scheduled_time = parent.first_scheduled_time
            self.pages.fork(parent, child)
            self.add_running(child)
            children.append(child)
        return children

    def compact(self) -> None:
        if self.sparse is not None:
            self.sparse.compact(self.running)

    def postprocess(self, sampled: list[Sequence], results: list[tuple[int, TokenLogprob | None]],
                    now: float) -> None:
        """Append each sampled token (moving its grammar on); end the sequences it stops (stop token, EOS,
        max_new_tokens, context)."""
        for seq, (token, logprob) in zip(sampled, results):
            seq.output_ids.append(token)
            if seq.matcher is not None:
                advance_grammar(seq.matcher, token)
            seq.token_times.append(now)
            if logprob is not None:
                seq.logprobs.append(logprob)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if self.is_stop_token(seq, token):
                self.finish(seq, FinishReason.STOP)
            elif len(seq.output_ids) >= seq.params.max_new_tokens or len(seq) >= (seq.max_len or 1 << 30):
                self.finish(seq, FinishReason.LENGTH)

    def is_stop_token(self, seq: Sequence, token: int) -> bool:
        p = seq.params
        return token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos)
