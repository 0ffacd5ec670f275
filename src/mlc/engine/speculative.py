"""Speculative decoding: propose drafts and keep the statistics of what verification accepted. Drafts come from
prompt lookup (the tokens that followed the last occurrence of a sequence's latest n tokens), from the model's own
multi-token-prediction layer (`mtp`: `Speculator.mtp_pass` runs it after each step and leaves its token in
`DraftState.mtp_next`; further drafts chain it after scheduling) or from a draft model (`draft_model`: it runs after
scheduling, `engine/draft_model.py`); those that run after scheduling fill the room left for them
(`Speculator.fill_drafts`).

The drafter only proposes. The scheduler gives a sequence's drafts room in the step (`ScheduledSeq.num_draft`),
the model runner runs each draft as a decode row of its own (`model_runner.prepare_step`: the same page table, one
more token of context per row), so every row's logits have the bits the one-token step gives, and the engine
verifies them in rounds (`LLMEngine._verify`): round j samples row j as the plain path samples a token (penalties,
grammar, logprobs, the request's generator) and the sequence goes on to row j+1 only if that token is draft j.
Because a draft is a single token, not a distribution, sampling row j and comparing is rejection sampling: draft j
is kept with the target probability of that token, and otherwise the token drawn is a draw from the target with
draft j removed, renormalized. The output is the one plain decoding gives: greedy, the same tokens; sampling, the
same distribution. The scheduler then counts the accepted drafts as cached and frees the pages only rejected drafts
used (`Scheduler.accept`), so only accepted tokens ever reach the prefix cache.

Drafting turns itself down where it does not pay: no match, no proposal; a proposal with nothing accepted makes
that sequence wait 1, 2, 4 ... 32 steps before it drafts again, and a partly accepted one proposes one token more
than was accepted next time; with more than `disable_by_batch_size` running sequences nobody drafts.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from mlc.config.engine_config import SpeculativeConfig
from mlc.engine.model_runner import ModelRunner, MtpRows, StepOutput
from mlc.engine.sequence import ScheduledSeq

if TYPE_CHECKING:
    from mlc.engine.draft_model import DraftModel
    from mlc.engine.sequence import Sequence

MAX_POSITIONS = 16  # SpeculativeConfig.num_speculative_tokens' bound
MAX_COOLDOWN = 32
LOOKBACK = 16384  # tokens of a long prompt the index covers: its end, where a reply most often copies from

OFF = "off"  # `Sequence.drafter` of a sequence whose drafting failed: it decodes without drafts
PENDING = -1  # room for a draft that runs after scheduling (a draft model's, a chained MTP's): `fill_drafts`

log = logging.getLogger("mlc.engine")


class Joined:
    """A prompt and its output read as one token list, by slices, without copying either (a sequence's ids are
    looked up every step it drafts; joining them would copy the whole context each time)."""

    __slots__ = ("head", "tail")

    def __init__(self, head: list[int], tail: list[int]) -> None:
        self.head, self.tail = head, tail

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)

    def __getitem__(self, s: slice) -> list[int]:
        start, stop, _ = s.indices(len(self))
        cut = len(self.head)
        if stop <= cut:
            return self.head[start:stop]
        if start >= cut:
            return self.tail[start - cut : stop - cut]
        return self.head[start:] + self.tail[: stop - cut]


Tokens = list[int] | Joined


class NgramIndex:
    """For each n-gram of a growing token list (n in [lo, hi]), the position just after its latest occurrence
    that has a token after it. Kept up to date incrementally: a step costs a few dict writes per new token."""

    def __init__(self, lo: int, hi: int) -> None:
        self.sizes = range(hi, lo - 1, -1)  # longest first: a longer match is the better predictor
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.size = 0

    def extend(self, tokens: Tokens) -> None:
        # p: a position with a token at it, after an n-gram
        for p in range(max(self.size, 1, len(tokens) - LOOKBACK), len(tokens)):
            for n, m in self.maps.items():
                if p >= n:
                    m[tuple(tokens[p - n : p])] = p
        self.size = max(self.size, len(tokens))

    def continuation(self, suffix_of: Tokens, source: Tokens, k: int) -> list[int]:
        """Up to `k` tokens of `source` that followed the latest occurrence of `suffix_of`'s last n tokens."""
        for n in self.sizes:
            if len(suffix_of) < n:
                continue
            p = self.maps[n].get(tuple(suffix_of[-n:]))
            if p is not None:
                return source[p : p + k]
        return []


@dataclass
class DraftState:
    """A sequence's own drafting state (`Sequence.drafter`)."""

    index: NgramIndex | None  # None: drafts come from the MTP layer or the draft model
    prediction: NgramIndex | None = None
    limit: int = 0  # drafts to propose next time
    misses: int = 0  # proposals in a row of which nothing was accepted
    cooldown: int = 0  # steps left before the next proposal
    mtp_next: int | None = None  # the MTP layer's token for the step after the next (unused yet)
    mtp_hidden: torch.Tensor | None = None  # the MTP layer's output that drafted it: a further draft reads it
    draft_cached: int | None = None  # draft_model: positions of its cache that are valid (engine/draft_model.py)


@dataclass
class SpecStats:
    """Counters since the engine started: `/metrics`, the dashboard and `bench` read them."""

    proposals: int = 0  # sequence-steps that carried drafts
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted
    drafted_at: list[int] = field(default_factory=lambda: [0] * MAX_POSITIONS)  # by position in the draft
    accepted_at: list[int] = field(default_factory=lambda: [0] * MAX_POSITIONS)
    draft_time_s: float = 0.0  # time spent proposing

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verified sequence-step emitted on average: accepted drafts plus the one token every step gives."""
        return 1.0 + self.accepted / self.proposals if self.proposals else 0.0


class Speculator:
    """Proposes drafts for the running sequences before each step and records what verification kept.

    `config` None: the engine has no speculative decoding, but a request that brings a `prediction` still drafts
    from it (with the defaults of `SpeculativeConfig`), unless `predictions` is false (sparse KV compacts the
    cache between a step and its verification)."""

    def __init__(self, config: SpeculativeConfig | None, predictions: bool = True) -> None:
        self.enabled = config is not None
        self.predictions = predictions
        self.config = config or SpeculativeConfig()
        self.mtp = self.enabled and self.config.method == "mtp"
        self.draft_model: DraftModel | None = None  # method draft_model: set by the engine with the loaded model
        self.runner: ModelRunner | None = None  # method mtp: runs the MTP layer (set by the engine)
        self.stats = SpecStats()

    def crowded(self, batch: int) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is not None and batch > limit

    def wants_mtp(self, seq: Sequence) -> bool:
        """The MTP layer's token is worth its head's cost for `seq`: it may draft next step."""
        state = seq.drafter
        cooling = isinstance(state, DraftState) and (state.cooldown or state.index is not None)
        return self.mtp and seq.params.speculative and state is not OFF and not cooling

    def fill_drafts(self, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """After scheduling, the drafts that need the room the scheduler left: the draft model reads what each
        sequence computes this step and drafts into it (`engine/draft_model.py`), and the MTP layer runs again on
        its own guess (`_mtp_chain`). A draft the grammar forbids ends the sequence's drafts there. A failure costs
        the step its drafts, never a request."""
        chain = self.mtp and self.runner is not None and any(item.num_draft > 1 for item in scheduled)
        if not scheduled or (self.draft_model is None and not chain):
            return scheduled
        start = time.perf_counter()
        try:
            drafts = self._run_draft_model(scheduled) if self.draft_model is not None else self._mtp_chain(scheduled)
        except Exception as e:  # what it wrote lies past each sequence's valid cache: written again later
            log.warning("drafting failed (%s: %s); this step verifies no drafts", type(e).__name__, e)
            drafts = {}
        out = []
        for item in scheduled:
            if item.num_draft:
                seq = item.seq
                own = list(itertools.takewhile(lambda t: t != PENDING, seq.draft_ids[: item.num_draft]))
                ran = drafts.get(seq.seq_id)  # None: nothing ran for it (its own drafts, checked when proposed)
                seq.draft_ids = own if ran is None else self._allowed(seq, ran[: item.num_draft])
                cut = item.num_draft - len(seq.draft_ids)
                item = ScheduledSeq(seq, item.num_tokens - cut, item.num_draft - cut) if cut else item
            out.append(item)
        self.stats.draft_time_s += time.perf_counter() - start
        return out

    def _run_draft_model(self, scheduled: list[ScheduledSeq]) -> dict[int, list[int]]:
        assert self.draft_model is not None
        states = {item.seq.seq_id: item.seq.drafter for item in scheduled if isinstance(item.seq.drafter, DraftState)}
        cached = {i: st.draft_cached for i, st in states.items() if st.draft_cached is not None}
        rooms = {item.seq.seq_id for item in scheduled if PENDING in item.seq.draft_ids[: item.num_draft]}
        drafts = self.draft_model.fill(scheduled, cached, rooms)
        for i, st in states.items():
            st.draft_cached = cached[i]
        return drafts

    def _mtp_chain(self, scheduled: list[ScheduledSeq]) -> dict[int, list[int]]:
        """Drafts 2.. of MTP sequences: the layer again, on its last guess beside its own output for the position
        before (vLLM chains one MTP layer so); each writes the layer's cache at a slot the target's verify rows
        reserve, which the next step's pass writes again with the target's own hidden state."""
        assert self.runner is not None
        going = [item for item in scheduled if item.num_draft > 1 and PENDING in item.seq.draft_ids]
        drafts = {item.seq.seq_id: list(item.seq.draft_ids[:1]) for item in going}
        hidden = {item.seq.seq_id: cast(DraftState, item.seq.drafter).mtp_hidden for item in going}
        if not going:
            return drafts
        for j in range(1, max(item.num_draft for item in going)):
            going = [item for item in going if item.num_draft > j and hidden[item.seq.seq_id] is not None]
            if not going:
                break
            jobs = [MtpRows(i, item.seq.num_cached + j - 1, drafts[item.seq.seq_id][-1:], item.seq.page_table, True)
                    for i, item in enumerate(going)]
            before = torch.stack([cast(torch.Tensor, hidden[item.seq.seq_id]) for item in going])
            tokens, outs = self.runner.run_mtp(before, jobs)
            for item, token, out in zip(going, tokens, outs):
                drafts[item.seq.seq_id].append(cast(int, token))
                hidden[item.seq.seq_id] = out
        return drafts

    def mtp_pass(self, step: StepOutput, completed: set[int], accepted: dict[int, int],
                 failed: dict[str, Exception], running: int) -> None:
        """The MTP layer (models/mtp.py) over what the step kept of each sequence: its cache slots filled, and its
        token for the step after the next left for `propose`. Drafts are only proposals, so a failure here costs
        speed, never a request."""
        assert step.hidden is not None and self.runner is not None
        runner = self.runner
        seqs, jobs = self._mtp_jobs(step.scheduled, completed, accepted, failed, running)
        start = time.perf_counter()
        try:
            drafts, outs = runner.run_mtp(step.hidden, jobs)
        except Exception as e:
            log.warning("the MTP layer failed (%s: %s); this step proposes no drafts", type(e).__name__, e)
            drafts, outs = [None] * len(jobs), [None] * len(jobs)
        for seq, job, token, out in zip(seqs, jobs, drafts, outs):
            if job.draft:
                state = self.start(seq)
                state.mtp_next, state.mtp_hidden = token, out
            elif isinstance(seq.drafter, DraftState):  # never a token left from an earlier position
                seq.drafter.mtp_next = seq.drafter.mtp_hidden = None
        self.stats.draft_time_s += time.perf_counter() - start

    def _mtp_jobs(self, scheduled: list[ScheduledSeq], completed: set[int], accepted: dict[int, int],
                  failed: dict[str, Exception], running: int) -> tuple[list[Sequence], list[MtpRows]]:
        """What the MTP layer computes after a step (models/mtp.py): for each sequence that ran and goes on, the
        positions the step kept (a prompt chunk, or the next token and its accepted drafts), each with the token
        after it; the last row is scored where the sequence completed its step and may draft next."""
        seqs: list[Sequence] = []
        jobs: list[MtpRows] = []
        drafting = not self.crowded(running)
        row = 0
        for item in scheduled:
            seq, first = item.seq, row
            row += item.num_tokens
            if seq.is_finished or seq.request_id in failed:
                continue
            kept = 1 + accepted.get(seq.seq_id, 0) if item.num_draft else item.num_tokens
            start = seq.num_cache_entries - kept
            tokens = Joined(seq.prompt_ids, seq.output_ids)[start + 1 : start + 1 + kept]
            if len(tokens) < kept:
                continue
            want = drafting and seq.seq_id in completed and self.wants_mtp(seq)
            seqs.append(seq)
            jobs.append(MtpRows(first, start, tokens, seq.page_table, want))
        return seqs, jobs

    def propose(self, running: list[Sequence]) -> None:
        """Set `draft_ids` of each running sequence whose next step is a decode (empty: none)."""
        start = time.perf_counter()
        crowded = self.crowded(len(running))
        for seq in running:
            try:
                seq.draft_ids = [] if crowded else self._draft(seq)
            except Exception as e:  # a drafter's failure costs its sequence the speed-up, never a request
                seq.draft_ids, seq.drafter = [], OFF
                log.warning("drafting for request %s failed (%s: %s); it decodes without drafts",
                            seq.request_id, type(e).__name__, e)
        self.stats.draft_time_s += time.perf_counter() - start

    def _draft(self, seq: Sequence) -> list[int]:
        p = seq.params
        wanted = p.speculative and (self.enabled or bool(p.prediction) and self.predictions)
        if not wanted or seq.drafter is OFF or seq.num_uncomputed != 1 or not seq.output_ids:
            return []
        state = self.start(seq)
        if state.cooldown:
            state.cooldown -= 1
            return []
        room = min(p.max_new_tokens - len(seq.output_ids), (seq.max_len or 1 << 30) - len(seq)) - 1
        k = min(state.limit, room)
        if k <= 0:
            return []
        if state.index is None and self.draft_model is not None:
            return [PENDING] * k  # room the scheduler trims; `fill_drafts` runs the draft model in it
        if state.index is None:  # MTP: the token its layer left after the last step, then room to chain it
            draft, state.mtp_next = ([] if state.mtp_next is None else [state.mtp_next]), None
            draft = self._allowed(seq, draft)
            return draft + [PENDING] * (k - 1) if draft and state.mtp_hidden is not None else draft
        tokens = Joined(seq.prompt_ids, seq.output_ids)
        state.index.extend(tokens)
        draft = state.prediction.continuation(tokens, p.prediction, k) if state.prediction and p.prediction else []
        return self._allowed(seq, draft or state.index.continuation(tokens, tokens, k))

    @staticmethod
    def _allowed(seq: Sequence, draft: list[int]) -> list[int]:
        if draft and seq.matcher is not None and not seq.matcher.is_stopped():
            draft = draft[: seq.matcher.validate_tokens(draft)]  # never propose what the grammar forbids
        return draft

    def start(self, seq: Sequence) -> DraftState:
        """The sequence's drafting state (made at its first use)."""
        return seq.drafter if isinstance(seq.drafter, DraftState) else self._start(seq)

    def _start(self, seq: Sequence) -> DraftState:
        c = self.config
        lookup = not self.enabled or c.method == "ngram" or bool(seq.params.prediction)  # a prediction still drafts
        index = NgramIndex(c.prompt_lookup_min, c.prompt_lookup_max) if lookup else None
        state = DraftState(index, limit=c.num_speculative_tokens)
        if seq.params.prediction:
            state.prediction = NgramIndex(c.prompt_lookup_min, c.prompt_lookup_max)
            state.prediction.extend(seq.params.prediction)
        seq.drafter = state
        return state

    def snapshot(self) -> SpecStats:
        """A copy of the counters, safe to read on another thread."""
        s = self.stats
        return SpecStats(s.proposals, s.drafted, s.accepted, list(s.drafted_at), list(s.accepted_at), s.draft_time_s)

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Verification kept `accepted` of the `drafted` tokens proposed for `seq`."""
        s = self.stats
        s.proposals += 1
        s.drafted += drafted
        s.accepted += accepted
        for j in range(min(drafted, MAX_POSITIONS)):
            s.drafted_at[j] += 1
            s.accepted_at[j] += j < accepted
        state = seq.drafter
        if not isinstance(state, DraftState):
            return
        if accepted == 0:
            state.misses += 1
            # an MTP layer is right most of the time: one miss is no reason to stop asking it
            cooling = state.misses - (state.index is None)
            state.cooldown = min(1 << (cooling - 1), MAX_COOLDOWN) if cooling > 0 else 0
            return
        state.misses = 0
        full = self.config.num_speculative_tokens
        state.limit = min(full, 2 * drafted) if accepted == drafted else max(1, accepted + 1)
