"""The waiting queue taken round-robin across fairness groups (the server passes one per API key): a group that
queued a burst cannot hold back another group's requests."""

from __future__ import annotations

from mlc.engine.page_manager import PageManager
from mlc.engine.sampling_params import SamplingParams
from mlc.engine.scheduler import Scheduler
from mlc.engine.sequence import Sequence


def seq(name: str, group: str | None) -> Sequence:
    return Sequence(name, [1, 2, 3, 4], SamplingParams(max_new_tokens=4), fair_group=group)


def sched(batch: int = 1) -> Scheduler:
    return Scheduler(PageManager(64, 4), max_batch_size=batch, max_num_batched_tokens=64)


def order(s: Scheduler) -> list[str]:
    return [q.request_id for q in s.waiting]


def test_ungrouped_requests_keep_arrival_order():
    s = sched()
    for i in range(5):
        s.add(seq(f"r{i}", None))
    assert order(s) == ["r0", "r1", "r2", "r3", "r4"]


def test_a_flood_does_not_starve_a_second_group():
    s = sched()
    for i in range(6):
        s.add(seq(f"a{i}", "flood"))
    s.add(seq("b0", "quiet"))
    assert order(s)[:2] == ["a0", "b0"]  # b's first request waits behind one of a's, not six
    s.add(seq("b1", "quiet"))
    s.add(seq("c0", None))  # requests with no group (plain --api-key) are a group of their own
    assert order(s) == ["a0", "b0", "c0", "a1", "b1", "a2", "a3", "a4", "a5"]


def test_admission_takes_the_groups_in_turn():
    s = sched(batch=1)
    for i in range(4):
        s.add(seq(f"a{i}", "flood"))
    for i in range(2):
        s.add(seq(f"b{i}", "quiet"))
    admitted = []
    while s.waiting:
        out = s.schedule()
        admitted += [item.seq.request_id for item in out.scheduled]
        for item in out.scheduled:  # each ends after its first step, making room for the next
            s.finish(item.seq)
    assert admitted == ["a0", "b0", "a1", "b1", "a2", "a3"]
