"""Prompt lookup and its bookkeeping, without a model: the n-gram index, what the speculator proposes and when it
backs off, the scheduler's room for drafts and what `accept` leaves in the pages and the prefix cache."""

from __future__ import annotations

import pytest

from mlc.config.engine_config import EngineConfig, SpeculativeConfig
from mlc.engine.sampling_params import SamplingParams
from mlc.engine.scheduler import ScheduledSeq
from mlc.engine.sequence import Sequence
from mlc.engine.speculative import OFF, NgramIndex, Speculator
from tests.unit.test_scheduler import check, make_sched, make_seq


def test_index_finds_the_latest_occurrence_of_the_longest_suffix():
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 7, 4, 2, 3]
    index = NgramIndex(1, 3)
    index.extend(tokens)
    # (4, 2, 3) never occurred before; (2, 3) last occurred at 5..6, followed by 8 7 4
    assert index.continuation(tokens, tokens, 3) == [8, 7, 4]
    assert index.continuation(tokens, tokens, 10) == [8, 7, 4, 2, 3]  # runs to the end of what is known
    assert index.continuation([5, 6], tokens, 3) == []


def test_index_built_step_by_step_equals_one_built_at_once():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    whole, grown = NgramIndex(1, 4), NgramIndex(1, 4)
    whole.extend(tokens)
    for end in range(1, len(tokens) + 1):
        grown.extend(tokens[:end])
    assert whole.maps == grown.maps


def running(prompt: list[int], output: list[int], **params) -> Sequence:
    seq = Sequence("r", prompt, SamplingParams(max_new_tokens=params.pop("max_new_tokens", 64), **params))
    seq.output_ids = list(output)
    seq.num_cached = len(seq) - 1  # decoding: only the last token is still to run
    return seq


def test_speculator_proposes_from_the_sequence_and_prefers_the_prediction():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3))
    seq = running([10, 11, 12, 13, 14, 15], [10, 11])
    spec.propose([seq])
    assert seq.draft_ids == [12, 13, 14]
    predicted = running([10, 11, 12, 13], [10, 11], prediction=[7, 10, 11, 99, 98])
    spec.propose([predicted])
    assert predicted.draft_ids == [99, 98]


def test_speculator_respects_the_request_the_length_and_the_batch():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=5, disable_by_batch_size=2))
    prompt = list(range(20, 40)) * 2
    off = running(prompt, [20, 21], speculative=False)
    short = running(prompt, [20, 21], max_new_tokens=4)  # 2 more tokens at most: one draft plus the bonus token
    spec.propose([off, short])
    assert off.draft_ids == [] and short.draft_ids == [22]
    crowd = [running(prompt, [20, 21]) for _ in range(3)]
    spec.propose(crowd)
    assert all(s.draft_ids == [] for s in crowd)
    prefill = running(prompt, [20, 21])
    prefill.num_cached = 5
    spec.propose([prefill])
    assert prefill.draft_ids == []
    # without a speculative config only a request's own prediction drafts
    plain = Speculator(None)
    a, b = running(prompt, [20, 21]), running(prompt, [20, 21], prediction=[20, 21, 5, 6])
    plain.propose([a, b])
    assert a.draft_ids == [] and b.draft_ids == [5, 6]


def test_speculator_backs_off_after_misses_and_adapts_the_length():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    seq = running(list(range(50, 60)) * 2, [50, 51])
    steps_between = []
    for _ in range(4):
        waited = 0
        spec.propose([seq])
        while not seq.draft_ids:
            waited += 1
            spec.propose([seq])
        steps_between.append(waited)
        spec.record(seq, len(seq.draft_ids), 0)
    assert steps_between == [0, 1, 2, 4]  # 1, 2, 4 ... steps of rest after each proposal that missed
    for _ in range(9):  # the cooldown (8 steps) runs out
        spec.propose([seq])
    assert seq.draft_ids
    spec.record(seq, 4, 1)
    spec.propose([seq])
    assert len(seq.draft_ids) == 2  # one more than was accepted
    spec.record(seq, 2, 2)
    spec.propose([seq])
    assert len(seq.draft_ids) == 4
    s = spec.stats
    assert (s.proposals, s.drafted, s.accepted) == (6, 4 * 4 + 4 + 2, 3)
    assert s.drafted_at[:4] == [6, 6, 5, 5] and s.accepted_at[:3] == [2, 1, 0]
    assert s.mean_accepted_length == pytest.approx(1 + 3 / 6)


def test_scheduler_gives_drafts_what_is_left_and_accept_keeps_only_accepted_tokens():
    sched = make_sched(num_pages=64, page_size=4, max_num_batched_tokens=64)
    seq = make_seq(10, max_new=32)
    sched.add(seq)
    out = sched.schedule()
    sched.advance(out.scheduled, {}, 0.0)
    sched.postprocess([seq], [(7, None)], 0.0)
    prompt_pages = len(seq.page_hashes)
    seq.draft_ids = [8, 9, 10, 11, 12, 13]
    out = sched.schedule()
    assert [(s.num_tokens, s.num_draft) for s in out.scheduled] == [(7, 6)]
    assert len(seq.page_table) == 5  # 11 + 6 entries
    sched.advance(out.scheduled, {}, 0.0)
    assert seq.num_cached == 11 and len(seq.page_hashes) == prompt_pages  # drafts do not count yet
    sched.postprocess([seq], [(8, None)], 0.0)
    sched.postprocess([seq], [(5, None)], 0.0)  # draft 0 accepted, draft 1 (9) rejected: 5 comes instead
    sched.accept(seq, 1)
    assert seq.draft_ids == [] and seq.num_cached == 12 == len(seq) - 1
    assert len(seq.page_table) == 3  # the pages only rejected drafts reached are free again
    check(sched)
    # the prefix cache holds exactly the full pages of accepted tokens
    held = {page: chunk for page, (_, chunk) in sched.pages.page_key.items()}
    for i, page in enumerate(seq.page_table[: seq.num_cached // 4]):
        assert held[page] == tuple(seq.all_ids[i * 4 : (i + 1) * 4])
    assert len(held) == seq.num_cached // 4


def test_drafts_give_way_to_the_budget_and_to_other_sequences_pages():
    sched = make_sched(num_pages=6, page_size=4, max_num_batched_tokens=4)
    seq = make_seq(6, max_new=32)
    sched.add(seq)
    sched.advance(sched.schedule().scheduled, {}, 0.0)  # 4 of 6 prompt tokens
    sched.advance(sched.schedule().scheduled, {}, 0.0)
    sched.postprocess([seq], [(7, None)], 0.0)
    seq.draft_ids = [1, 2, 3, 4, 5]
    out = sched.schedule()
    assert [(s.num_tokens, s.num_draft) for s in out.scheduled] == [(4, 3)]  # the step's budget is 4 tokens
    assert isinstance(out.scheduled[0], ScheduledSeq) and seq.draft_ids == [1, 2, 3]
    sched.advance(out.scheduled, {}, 0.0)
    sched.accept(seq, 0)
    other = make_seq(13, max_new=4)
    sched.add(other)
    sched.advance(sched.schedule().scheduled, {}, 0.0)
    check(sched)


def test_config_reads_json_and_refuses_what_is_not_built():
    cfg = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert cfg.speculative_config.num_speculative_tokens == 3
    with pytest.raises(ValueError, match="not built yet"):
        EngineConfig(speculative_config={"method": "eagle3", "model": "x"})
    with pytest.raises(ValueError, match='needs "model"'):
        EngineConfig(speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="only it takes one"):
        EngineConfig(speculative_config={"method": "ngram", "model": "x"})
    assert EngineConfig(speculative_config={"method": "mtp"}).speculative_config.num_speculative_tokens == 1
    with pytest.raises(ValueError, match="not JSON"):
        EngineConfig(speculative_config="{method: ngram}")
    with pytest.raises(ValueError, match="sparse_kv"):
        EngineConfig(speculative_config={}, sparse_kv={"ratio": 0.5})


def test_a_failing_drafter_leaves_its_sequence_without_drafts():
    class Broken:
        def is_stopped(self):
            return False

        def validate_tokens(self, tokens):
            raise RuntimeError("the matcher broke")

    spec = Speculator(SpeculativeConfig())
    seq, other = running(list(range(20, 40)) * 2, [20, 21]), running(list(range(20, 40)) * 2, [20, 21])
    seq.matcher = Broken()
    spec.propose([seq, other])
    assert seq.draft_ids == [] and seq.drafter is OFF and other.draft_ids == [22, 23, 24]
    spec.propose([seq])
    assert seq.draft_ids == []


def test_drafts_never_preempt_or_hold_back_another_sequence():
    sched = make_sched(num_pages=8, page_size=4, max_num_batched_tokens=64)  # 7 usable pages
    a, b = make_seq(11, max_new=32), make_seq(12, max_new=32)
    for seq in (a, b):
        sched.add(seq)
    out = sched.schedule()
    sched.advance(out.scheduled, {}, 0.0)
    sched.postprocess([a, b], [(7, None), (7, None)], 0.0)  # 3 pages each (b's full), one page free
    a.draft_ids = [1, 2, 3, 4, 5, 6]
    out = sched.schedule()  # b's next token needs the free page: a's drafts get none of it
    assert not out.preempted
    assert [(s.seq, s.num_tokens, s.num_draft) for s in out.scheduled] == [(a, 1, 0), (b, 1, 0)]
    sched.advance(out.scheduled, {}, 0.0)
    check(sched)


def test_joined_reads_prompt_and_output_as_one_list_without_copying_them():
    import random

    from mlc.engine.speculative import Joined

    rng = random.Random(0)
    for _ in range(200):
        head = [rng.randrange(50) for _ in range(rng.randrange(0, 6))]
        tail = [rng.randrange(50) for _ in range(rng.randrange(0, 6))]
        j, whole = Joined(head, tail), head + tail
        assert len(j) == len(whole)
        for a in range(-8, 9):
            for b in range(-8, 9):
                assert j[a:b] == whole[a:b]
        assert j[-3:] == whole[-3:] and j[2:] == whole[2:]
