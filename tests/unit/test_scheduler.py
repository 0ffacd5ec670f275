"""The scheduler on fake sequences: admission, the token budget, chunked prefill, preemption, and the updates after
a step (advance, fork, postprocess, finish), with a real PageManager whose accounting is audited after each step."""

from __future__ import annotations

import itertools

import pytest

from mlc.engine.page_manager import PageManager
from mlc.engine.sampling_params import SamplingParams
from mlc.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from mlc.engine.sequence import FinishReason, Sequence, Status, TokenLogprob

EOS = 2
TOKEN = 3  # a sampled token that stops nothing
_tokens = itertools.count(100)


def make_seq(prompt_len: int, max_new: int = 16, max_len: int | None = None, arrival: float | None = None,
             **params) -> Sequence:
    """A sequence with a prompt of fresh token ids (so no two prompts share a prefix-cache page by accident)."""
    prompt = [next(_tokens) for _ in range(prompt_len)]
    kw = {} if arrival is None else {"arrival_time": arrival}
    return Sequence("req", prompt, SamplingParams(max_new_tokens=max_new, **params), max_len=max_len, **kw)


def make_sched(num_pages=64, page_size=4, prefix=True, **kw) -> Scheduler:
    return Scheduler(PageManager(num_pages, page_size, enable_prefix_caching=prefix), eos_token_ids={EOS}, **kw)


def live(sched: Scheduler) -> list[Sequence]:
    return list(sched.running) + list(sched.waiting)


def check(sched: Scheduler, extra: list[Sequence] = ()) -> None:
    """Queues and pages are consistent (waiting sequences hold no pages)."""
    seqs = live(sched) + list(extra)
    assert sched.audit(seqs) == []
    assert sched.pages.audit(seqs) == []
    for s in sched.waiting:
        assert s.page_table == [] and s.status is Status.WAITING
    for s in sched.running:
        assert s.status is Status.RUNNING


def step(sched: Scheduler, token: int = TOKEN, now: float = 1.0) -> tuple[SchedulerOutput, list[Sequence]]:
    """What the engine does with one step, minus the model: schedule, advance, sample `token` for the due ones."""
    out = sched.schedule()
    due = sched.advance(out.scheduled, {}, now)
    sched.postprocess(due, [(token, None)] * len(due), now)
    check(sched)
    return out, due


def plan(out: SchedulerOutput) -> list[tuple[int, int]]:
    return [(s.seq.seq_id, s.num_tokens) for s in out.scheduled]


def drain(sched: Scheduler, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not sched.running and not sched.waiting:
            break
        out, _ = step(sched)
        assert out.scheduled or out.preempted, "no progress"
    assert not sched.running and not sched.waiting
    assert sched.pages.num_free_pages == sched.pages.usable_pages  # no page leaked
    assert sched.pages.audit([]) == []


# admission
def test_admission_is_fifo_and_bounded_by_max_batch_size():
    sched = make_sched(max_batch_size=2)
    a, b, c = make_seq(5), make_seq(5), make_seq(5)
    for s in (a, b, c):
        sched.add(s)
    assert all(s.status is Status.WAITING for s in (a, b, c))
    out, due = step(sched)
    assert plan(out) == [(a.seq_id, 5), (b.seq_id, 5)]
    assert sched.running == [a, b] and list(sched.waiting) == [c]
    assert due == [a, b] and c.page_table == []
    sched.finish(a, FinishReason.ABORT)
    out, _ = step(sched)
    assert plan(out) == [(b.seq_id, 1), (c.seq_id, 5)]  # the running decode first, then the admitted prompt
    assert sched.running == [b, c]
    drain(sched)


def test_a_waiting_prompt_that_does_not_fit_blocks_later_ones():
    """FIFO: a small request behind one that does not fit does not jump the queue."""
    sched = make_sched(num_pages=5, page_size=4)  # 4 usable pages: 16 slots
    a = make_seq(3, max_new=4)
    sched.add(a)
    step(sched)
    big, small = make_seq(12, max_new=4), make_seq(2, max_new=4)
    sched.add(big)
    sched.add(small)
    out, _ = step(sched)
    assert plan(out) == [(a.seq_id, 1)]
    assert list(sched.waiting) == [big, small]
    sched.finish(a, FinishReason.ABORT)
    out, _ = step(sched)
    assert [s.seq for s in out.scheduled] == [big]
    drain(sched)
    assert small.finish_reason is FinishReason.LENGTH


def test_admission_keeps_a_reserve_for_running_sequences():
    sched = make_sched(num_pages=5, page_size=4)  # 4 usable pages: 16 slots
    a = make_seq(3, max_new=4)  # one page
    sched.add(a)
    step(sched)
    assert sched.pages.num_free_pages == 3
    b = make_seq(12, max_new=4)  # three pages: would leave none for `a` to grow into
    sched.add(b)
    out, _ = step(sched)
    assert [s.seq for s in out.scheduled] == [a] and list(sched.waiting) == [b]
    assert b.page_table == [] and sched.pages.num_free_pages == 3
    sched.finish(a, FinishReason.ABORT)
    out, _ = step(sched)  # nothing running: no reserve needed
    assert plan(out) == [(b.seq_id, 12)]

    sched2 = make_sched(num_pages=5, page_size=4)
    whole = make_seq(16)  # the entire pool, admitted because nothing else runs
    sched2.add(whole)
    out = sched2.schedule()
    assert plan(out) == [(whole.seq_id, 16)] and sched2.pages.num_free_pages == 0
    sched2.finish(whole, FinishReason.ABORT)
    drain(sched)
    drain(sched2)


def test_admission_with_room_for_the_reserve_goes_ahead():
    sched = make_sched(num_pages=5, page_size=4)
    a = make_seq(3, max_new=4)
    sched.add(a)
    step(sched)
    b = make_seq(8, max_new=4)  # two pages + one reserved <= three free
    sched.add(b)
    out, _ = step(sched)
    assert plan(out) == [(a.seq_id, 1), (b.seq_id, 8)]
    drain(sched)


# the token budget
def test_chunked_prefill_splits_a_long_prompt_into_budget_sized_chunks():
    sched = make_sched(max_num_batched_tokens=8)
    s = make_seq(20)
    sched.add(s)
    cached = []
    for expected in (8, 8, 4):
        out, due = step(sched)
        assert plan(out) == [(s.seq_id, expected)]
        cached.append(s.num_cached)
        if expected != 4:
            assert due == [] and s.output_ids == []  # nothing sampled mid-prompt
    assert cached == [8, 16, 20]
    assert due == [s] and s.output_ids == [TOKEN]
    out, _ = step(sched)
    assert plan(out) == [(s.seq_id, 1)]
    drain(sched)


def test_running_decodes_come_first_and_the_rest_of_the_budget_prefills():
    sched = make_sched(max_num_batched_tokens=8)
    a = make_seq(3)
    sched.add(a)
    step(sched)
    b = make_seq(20)
    sched.add(b)
    chunks = []
    while not b.output_ids:
        out, _ = step(sched)
        assert out.scheduled[0].seq is a and out.scheduled[0].num_tokens == 1
        assert out.num_tokens <= 8
        chunks.append(out.scheduled[1].num_tokens)
    assert chunks == [7, 7, 6]
    drain(sched)


def test_the_budget_is_never_exceeded_in_chunked_mode():
    sched = make_sched(num_pages=40, page_size=4, max_batch_size=4, max_num_batched_tokens=10)
    for n in (3, 17, 9, 25, 1, 12):
        sched.add(make_seq(n, max_new=5))
    for _ in range(200):
        if not live(sched):
            break
        out, _ = step(sched)
        assert 0 < out.num_tokens <= 10
        assert len(sched.running) <= 4
    drain(sched)


def test_non_chunked_prompt_larger_than_the_remaining_budget_waits():
    sched = make_sched(max_num_batched_tokens=8, enable_chunked_prefill=False)
    a = make_seq(3)
    sched.add(a)
    step(sched)
    b = make_seq(10)
    sched.add(b)
    out, _ = step(sched)
    assert plan(out) == [(a.seq_id, 1)]  # b would need 10 of the 7 left: it waits whole, holding no pages
    assert list(sched.waiting) == [b] and b.page_table == [] and b.num_cached == 0
    c = make_seq(7)  # behind b in the queue
    sched.add(c)
    out, _ = step(sched)
    assert plan(out) == [(a.seq_id, 1)]
    sched.finish(a, FinishReason.ABORT)
    out, _ = step(sched)  # the batch is empty: b runs whole even beyond the budget
    assert plan(out) == [(b.seq_id, 10)]
    assert list(sched.waiting) == [c]
    out, _ = step(sched)
    assert plan(out) == [(b.seq_id, 1), (c.seq_id, 7)]  # 1 + 7 fits the budget exactly
    drain(sched)


def test_non_chunked_prompt_that_fits_is_admitted_whole():
    sched = make_sched(max_num_batched_tokens=8, enable_chunked_prefill=False)
    a = make_seq(12)
    sched.add(a)
    out, due = step(sched)
    assert plan(out) == [(a.seq_id, 12)] and due == [a]
    drain(sched)


# preemption
def _three_full_pages(prefix=False):
    """Four usable pages of two slots; three 2-token prompts each fill a page, then all want a second page."""
    sched = make_sched(num_pages=5, page_size=2, prefix=prefix, max_batch_size=3)
    seqs = [make_seq(2, max_new=6) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    out, due = step(sched)
    assert due == seqs and sched.pages.num_free_pages == 1
    return sched, seqs


def test_the_newest_running_sequence_is_preempted_when_pages_run_out():
    sched, (a, b, c) = _three_full_pages()
    d = make_seq(2, max_new=6)
    sched.add(d)  # the batch is full: d waits
    out, due = step(sched)
    assert out.preempted == [c]
    assert [s.seq for s in out.scheduled] == [a, b]
    assert due == [a, b]
    assert sched.running == [a, b]
    assert list(sched.waiting) == [c, d]  # the preempted sequence goes first
    assert c.status is Status.WAITING and c.page_table == [] and c.num_cached == 0
    assert c.output_ids == [TOKEN]  # it keeps its tokens and recomputes them
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert a.num_preemptions == b.num_preemptions == 0
    sched.finish(a, FinishReason.ABORT)
    sched.finish(b, FinishReason.ABORT)
    out, _ = step(sched)
    assert plan(out)[0] == (c.seq_id, 3)  # its prompt and the token it had sampled, recomputed
    drain(sched)


def test_nothing_is_admitted_in_a_step_that_preempted():
    sched, (a, b, c) = _three_full_pages()
    sched.max_batch_size = 10
    d = make_seq(1, max_new=6)
    sched.add(d)
    out, _ = step(sched)
    assert out.preempted == [c]
    assert d not in [s.seq for s in out.scheduled] and list(sched.waiting) == [c, d]
    drain(sched)


def test_a_sequence_preempts_itself_when_every_other_one_is_already_scheduled():
    sched = make_sched(num_pages=4, page_size=2, prefix=False)  # three usable pages
    a, b = make_seq(2, max_new=4), make_seq(2, max_new=4)
    sched.add(a)
    sched.add(b)
    step(sched)
    out, _ = step(sched)  # a takes the last page; b has nobody left to preempt but itself
    assert [s.seq for s in out.scheduled] == [a] and out.preempted == [b]
    assert list(sched.waiting) == [b] and b.num_preemptions == 1
    drain(sched)


def test_preemption_under_pressure_never_leaks_pages():
    sched = make_sched(num_pages=9, page_size=2, max_batch_size=6, max_num_batched_tokens=6)
    seqs = [make_seq(n, max_new=6) for n in (3, 1, 4, 2, 5, 2, 3)]
    for s in seqs:
        sched.add(s)
    drain(sched)
    assert sched.num_preemptions > 0
    assert all(s.finish_reason is FinishReason.LENGTH and len(s.output_ids) == 6 for s in seqs)
    assert sum(s.num_preemptions for s in seqs) == sched.num_preemptions


# advance
def test_advance_moves_counts_and_returns_exactly_the_completed_sequences():
    sched = make_sched(max_num_batched_tokens=10)
    a, b = make_seq(4, prompt_logprobs=True), make_seq(9)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert plan(out) == [(a.seq_id, 4), (b.seq_id, 6)]
    assert [s.completes for s in out.scheduled] == [True, False]
    due = sched.advance(out.scheduled, {a.seq_id: [-1.0, -2.0, -3.0]}, now=5.0)
    assert due == [a]
    assert (a.num_cached, b.num_cached) == (4, 6)
    assert a.num_cache_entries == 4 and b.num_cache_entries == 6
    assert a.prompt_logprobs == [-1.0, -2.0, -3.0] and b.prompt_logprobs == []
    assert a.first_scheduled_time == b.first_scheduled_time == 5.0
    sched.postprocess(due, [(TOKEN, None)], now=5.0)
    out = sched.schedule()
    assert plan(out) == [(a.seq_id, 1), (b.seq_id, 3)]
    due = sched.advance(out.scheduled, {}, now=6.0)
    assert due == [a, b]
    assert b.first_scheduled_time == 5.0  # set once, at the first step
    assert (a.num_cached, b.num_cached) == (5, 9)
    sched.postprocess(due, [(TOKEN, None)] * 2, now=6.0)
    check(sched)
    drain(sched)


def test_prompt_logprobs_accumulate_across_chunks():
    sched = make_sched(max_num_batched_tokens=4)
    s = make_seq(7, prompt_logprobs=True)
    sched.add(s)
    out = sched.schedule()
    sched.advance(out.scheduled, {s.seq_id: [-0.1, -0.2, -0.3, -0.4]}, now=1.0)
    out = sched.schedule()
    assert plan(out) == [(s.seq_id, 3)]
    assert sched.advance(out.scheduled, {s.seq_id: [-0.5, -0.6]}, now=2.0) == [s]
    assert s.prompt_logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6]
    assert s.first_scheduled_time == 1.0


def test_advance_makes_full_prompt_pages_findable_by_later_prompts():
    sched = make_sched(page_size=4)
    a = make_seq(9)
    sched.add(a)
    step(sched)
    b = Sequence("other", list(a.prompt_ids), SamplingParams(max_new_tokens=2))
    sched.add(b)
    out, _ = step(sched)
    assert plan(out) == [(a.seq_id, 1), (b.seq_id, 1)]  # two full pages from the cache, the last token recomputed
    assert b.num_prefix_hit == 8
    assert b.page_table[:2] == a.page_table[:2]
    assert all(sched.pages.ref[p] == 2 for p in a.page_table[:2])
    drain(sched)


# fork
def test_fork_children_share_the_parents_pages_and_join_the_batch():
    sched = make_sched(page_size=4)
    parent = make_seq(6, max_new=3, n=3, seed=11)
    sched.add(parent)
    out = sched.schedule()
    assert sched.advance(out.scheduled, {}, now=2.0) == [parent]
    pages = list(parent.page_table)
    children = sched.fork(parent, 2)
    assert [c.sample_index for c in children] == [1, 2]
    for c in children:
        assert c.request_id == parent.request_id and c.prompt_ids == parent.prompt_ids
        assert c.params is parent.params and c.max_len == parent.max_len
        assert c.arrival_time == parent.arrival_time and c.first_scheduled_time == 2.0
        assert c.page_table == pages and c.status is Status.RUNNING
        assert c.num_cached == c.num_cache_entries == 6
        assert c.generator is not None
    assert sched.running == [parent, *children]
    assert all(sched.pages.ref[p] == 3 for p in pages)
    check(sched)
    sched.postprocess([parent, *children], [(10, None), (11, None), (12, None)], now=2.0)
    out = sched.schedule()  # all three write into the shared, half-full last page: copy on write
    assert plan(out) == [(s.seq_id, 1) for s in (parent, *children)]
    assert len(out.copies) == 2
    assert all(c.src == pages[-1] and c.num_entries == 2 for c in out.copies)
    last = [s.page_table[-1] for s in (parent, *children)]
    assert len(set(last)) == 3
    assert all(s.page_table[0] == pages[0] for s in (parent, *children)) and sched.pages.ref[pages[0]] == 3
    sched.advance(out.scheduled, {}, now=3.0)
    check(sched)
    sched.postprocess([parent, *children], [(TOKEN, None)] * 3, now=3.0)
    drain(sched)
    assert [len(s.output_ids) for s in (parent, *children)] == [3, 3, 3]


# postprocess
def _decoding(sched, **kw) -> Sequence:
    s = make_seq(3, **kw)
    sched.add(s)
    out = sched.schedule()
    sched.advance(out.scheduled, {}, now=0.5)
    return s


def test_postprocess_appends_token_logprob_and_times():
    sched = make_sched()
    s = _decoding(sched)
    lp = TokenLogprob(TOKEN, -0.5)
    sched.postprocess([s], [(TOKEN, lp)], now=1.0)
    sched.postprocess([s], [(TOKEN + 1, None)], now=2.0)
    assert s.output_ids == [TOKEN, TOKEN + 1]
    assert s.logprobs == [lp]
    assert s.token_times == [1.0, 2.0]
    assert s.first_token_time == 1.0
    assert not s.is_finished and s.finish_reason is None
    sched.finish(s, FinishReason.ABORT)
    drain(sched)


@pytest.mark.parametrize(
    "params, token, reason",
    [
        ({"stop_token_ids": [7]}, 7, FinishReason.STOP),
        ({"stop_token_ids": [7], "ignore_eos": True}, 7, FinishReason.STOP),
        ({}, EOS, FinishReason.STOP),
        ({"ignore_eos": True}, EOS, None),
        ({}, TOKEN, None),
        ({"max_new_tokens": 1}, TOKEN, FinishReason.LENGTH),
        ({"max_new_tokens": 1, "stop_token_ids": [7]}, 7, FinishReason.STOP),
    ],
)
def test_postprocess_ends_sequences(params, token, reason):
    sched = make_sched()
    kw = dict(params)
    s = _decoding(sched, max_new=kw.pop("max_new_tokens", 16), **kw)
    pages = list(s.page_table)
    sched.postprocess([s], [(token, None)], now=1.0)
    assert s.output_ids == [token]  # the stopping token is part of the output
    assert s.finish_reason is reason
    if reason is None:
        assert s.status is Status.RUNNING and s in sched.running and s.page_table == pages
        sched.finish(s, FinishReason.ABORT)
    else:
        assert s.status is Status.FINISHED and s.is_finished
        assert s not in sched.running and s.page_table == [] and s.num_cached == 0
    drain(sched)


def test_postprocess_ends_a_sequence_at_its_max_len():
    sched = make_sched()
    s = _decoding(sched, max_new=100, max_len=5)
    sched.postprocess([s], [(TOKEN, None)], now=1.0)
    assert not s.is_finished
    out, _ = step(sched)
    assert s.finish_reason is FinishReason.LENGTH and len(s) == 5
    drain(sched)


def test_max_new_tokens_counts_every_sampled_token():
    sched = make_sched()
    s = make_seq(3, max_new=4)
    sched.add(s)
    drain(sched)
    assert len(s.output_ids) == 4 and s.finish_reason is FinishReason.LENGTH
    assert len(s.token_times) == 4


def test_finish_reasons_serialize_as_their_values():
    assert [str(r) for r in FinishReason] == ["stop", "length", "abort", "timeout", "error"]
    assert FinishReason.STOP == "stop"


# finish
def test_finish_a_running_sequence_frees_its_pages():
    sched = make_sched()
    s = _decoding(sched)
    assert s.page_table
    sched.finish(s, FinishReason.ABORT)
    assert s.status is Status.FINISHED and s.finish_reason is FinishReason.ABORT
    assert s not in sched.running and s.page_table == []
    assert sched.pages.num_free_pages == sched.pages.usable_pages
    check(sched)


def test_finish_a_waiting_sequence_removes_it_from_the_queue():
    sched = make_sched()
    a, b = make_seq(3), make_seq(3)
    sched.add(a)
    sched.add(b)
    sched.finish(a, FinishReason.TIMEOUT)
    assert list(sched.waiting) == [b] and a.finish_reason is FinishReason.TIMEOUT and a.is_finished
    check(sched)
    drain(sched)


def test_finish_without_a_reason_releases_a_sequence_that_already_ended():
    sched = make_sched()
    s = _decoding(sched)
    s.finish(FinishReason.STOP)  # ended elsewhere (a stop string), still queued and holding pages
    sched.finish(s)
    assert s.finish_reason is FinishReason.STOP
    assert s not in sched.running and s.page_table == []
    assert sched.pages.num_free_pages == sched.pages.usable_pages
    sched.finish(s)  # releasing twice is harmless
    assert sched.pages.audit([]) == [] and sched.audit([]) == []


def test_finish_leaves_sibling_samples_alone():
    sched = make_sched(page_size=4)
    parent = _decoding(sched, n=2)
    (child,) = sched.fork(parent, 1)
    sched.finish(parent, FinishReason.ABORT)
    assert sched.running == [child] and child.page_table and not child.is_finished
    check(sched)
    sched.postprocess([child], [(TOKEN, None)], now=1.0)
    drain(sched)


# audit and requeue_all
def test_audit_is_empty_for_a_consistent_state():
    sched = make_sched(max_batch_size=2)
    for _ in range(3):
        sched.add(make_seq(3))
    step(sched)
    assert sched.audit(live(sched)) == []
    assert sched.audit([]) != []  # queued sequences the caller does not know about


def test_audit_reports_a_sequence_queued_twice():
    sched = make_sched()
    s = _decoding(sched)
    sched.waiting.append(s)
    assert any("queued twice" in p for p in sched.audit([s]))
    sched.waiting.clear()
    sched.running.append(s)
    assert any("queued twice" in p for p in sched.audit([s]))


def test_audit_reports_a_status_mismatch_and_unqueued_sequences():
    sched = make_sched()
    s = _decoding(sched)
    s.status = Status.WAITING
    problems = sched.audit([s])
    assert any(str(s.seq_id) in p and "waiting" in p for p in problems)
    s.status = Status.RUNNING
    lost = make_seq(2)  # live but in neither queue
    problems = sched.audit([s, lost])
    assert any(str(lost.seq_id) in p for p in problems)
    s.num_cached = len(s) + 1
    assert any("caches" in p for p in sched.audit([s]))


def test_requeue_all_puts_exactly_the_given_sequences_back_in_arrival_order():
    sched = make_sched(num_pages=16, page_size=4, max_num_batched_tokens=6)
    first = make_seq(5, max_new=4, arrival=1.0, n=2)
    second = make_seq(9, max_new=4, arrival=2.0)
    third = make_seq(3, max_new=4, arrival=3.0)
    for s in (first, second, third):
        sched.add(s)
    out = sched.schedule()
    due = sched.advance(out.scheduled, {}, now=1.0)
    assert due == [first]
    children = sched.fork(first, 1)
    sched.postprocess([first, *children], [(TOKEN, None)] * 2, now=1.0)
    check(sched)
    gone = third  # e.g. its request failed; the caller does not hand it back
    sched.pages.reset()
    keep = [second, children[0], first]
    sched.requeue_all(keep)
    assert sched.running == []
    assert list(sched.waiting) == [first, children[0], second]  # (arrival, sample index)
    for s in keep:
        assert s.status is Status.WAITING and s.page_table == [] and s.page_hashes == []
        assert s.num_cached == s.num_cache_entries == 0
    assert gone not in sched.waiting
    assert first.output_ids == [TOKEN]  # tokens survive: they are recomputed
    check(sched)
    drain(sched)
    assert all(len(s.output_ids) == 4 for s in keep)


def test_scheduled_seq_completes_when_the_step_covers_every_token():
    s = make_seq(5)
    assert ScheduledSeq(s, 5).completes and not ScheduledSeq(s, 4).completes
    s.num_cached = 3
    assert ScheduledSeq(s, 2).completes
    assert SchedulerOutput([ScheduledSeq(s, 2), ScheduledSeq(s, 3)]).num_tokens == 5
