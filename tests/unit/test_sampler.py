"""The sampler on small hand-made logits: greedy, temperature, top-k/top-p/min-p supports, penalties, min_new_tokens,
per-request seeds and the reported logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from mlc.engine.sampler import Sampler
from mlc.engine.sampling_params import SamplingParams
from mlc.engine.sequence import Sequence

VOCAB = 10
EOS = 9


def make_seq(prompt=(0,), output=(), sample_index=0, **params) -> Sequence:
    s = Sequence("r", list(prompt), SamplingParams(**params), sample_index=sample_index)
    s.output_ids = list(output)
    return s


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    """Logits whose softmax is `probs` (padded with near-zero mass up to VOCAB)."""
    probs = list(probs) + [1e-9] * (VOCAB - len(probs))
    return torch.log(torch.tensor(probs, dtype=torch.float32))


def draw(row: torch.Tensor, seq: Sequence, n: int = 2000, seed: int = 0) -> Counter:
    """`n` draws for one sequence from the same logits row (each row of a batch draws once)."""
    out = Sampler({EOS}, seed=seed)(row.expand(n, -1), [seq] * n)
    return Counter(t for t, _ in out)


def freqs(counts: Counter) -> torch.Tensor:
    total = sum(counts.values())
    return torch.tensor([counts.get(i, 0) / total for i in range(VOCAB)])


ROW = torch.tensor([0.5, 2.0, -1.0, 1.0, 0.0, 1.5, -0.5, 0.2, -2.0, 0.8])  # argmax 1; order 1 5 3 9 0 7 4 6 2 8


# greedy and temperature
def test_greedy_is_the_argmax_of_each_row():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    seqs = [make_seq(temperature=0.0) for _ in range(6)]
    tokens = [t for t, _ in Sampler({EOS})(logits, seqs)]
    assert tokens == logits.argmax(dim=-1).tolist()


def test_greedy_rows_stay_greedy_next_to_sampled_rows():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    seqs = [make_seq(temperature=0.0), make_seq(temperature=1.0), make_seq(temperature=0.0), make_seq()]
    for seed in range(5):
        tokens = [t for t, _ in Sampler({EOS}, seed=seed)(logits, seqs)]
        assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_draws_follow_the_temperature_scaled_distribution(temperature):
    counts = draw(ROW, make_seq(temperature=temperature), n=4000)
    expected = torch.softmax(ROW / temperature, dim=-1)
    assert torch.allclose(freqs(counts), expected, atol=0.035)


def test_low_temperature_concentrates_on_the_argmax():
    cold = draw(ROW, make_seq(temperature=0.1))
    hot = draw(ROW, make_seq(temperature=2.0))
    assert cold[1] / 2000 > 0.99
    assert hot[1] / 2000 < 0.5 and len(hot) >= 8


def test_sampling_leaves_the_callers_logits_alone():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    seqs = [make_seq(output=[1, 1], repetition_penalty=2.0, presence_penalty=1.0, top_k=3),
            make_seq(temperature=0.0, min_new_tokens=5, max_new_tokens=8), make_seq(top_p=0.5, min_p=0.2)]
    Sampler({EOS})(logits, seqs)
    assert torch.equal(logits, before)


# top-k, top-p, min-p
@pytest.mark.parametrize("k", [1, 3, 5])
def test_top_k_draws_only_the_k_best(k):
    counts = draw(ROW, make_seq(top_k=k, temperature=1.5))
    best = set(ROW.topk(k).indices.tolist())
    assert set(counts) == best


@pytest.mark.parametrize("k", [0, -1, VOCAB, VOCAB + 5])
def test_top_k_off_or_at_least_the_vocabulary_keeps_every_token(k):
    counts = draw(ROW, make_seq(top_k=k, temperature=2.0), n=3000)
    assert set(counts) == set(range(VOCAB))


PROBS = [0.40, 0.30, 0.15, 0.10, 0.01, 0.01, 0.01, 0.01, 0.01]  # token 9 (EOS) ~0


@pytest.mark.parametrize("top_p, support", [(0.3, {0}), (0.65, {0, 1}), (0.8, {0, 1, 2}), (0.9, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, support):
    counts = draw(logits_from_probs(PROBS), make_seq(top_p=top_p))
    assert set(counts) == support


def test_top_p_renormalizes_over_the_kept_tokens():
    counts = draw(logits_from_probs(PROBS), make_seq(top_p=0.65), n=4000)
    assert abs(counts[0] / 4000 - 0.4 / 0.7) < 0.035


@pytest.mark.parametrize("min_p, support", [(0.3, {0, 1, 2}), (0.2, {0, 1, 2, 3}), (0.8, {0}), (0.7, {0, 1})])
def test_min_p_drops_tokens_below_min_p_times_the_top_probability(min_p, support):
    counts = draw(logits_from_probs(PROBS), make_seq(min_p=min_p))
    assert set(counts) == support


def test_top_k_then_top_p_then_min_p_compose():
    row = logits_from_probs(PROBS)
    assert set(draw(row, make_seq(top_k=2, top_p=0.9))) == {0, 1}  # top-k first narrows to two
    # top-k=3 renormalizes to .4/.85, .3/.85, .15/.85; top_p .8 then keeps 0 and 1 (mass .82)
    assert set(draw(row, make_seq(top_k=3, top_p=0.8))) == {0, 1}
    assert set(draw(row, make_seq(top_p=0.9, min_p=0.3))) == {0, 1, 2}


# penalties
def penalty_row(**tokens: float) -> torch.Tensor:
    row = torch.full((VOCAB,), -5.0)
    for name, value in tokens.items():
        row[int(name[1:])] = value
    return row


def greedy(row: torch.Tensor, **kw) -> int:
    return Sampler({EOS})(row[None], [make_seq(temperature=0.0, **kw)])[0][0]


def test_repetition_penalty_divides_positive_logits_of_seen_tokens():
    row = penalty_row(t1=2.0, t2=1.5)
    assert greedy(row, prompt=[1]) == 1
    assert greedy(row, prompt=[1], repetition_penalty=2.0) == 2  # 2.0 / 2 = 1.0 < 1.5
    assert greedy(row, prompt=[1], repetition_penalty=1.2) == 1  # 2.0 / 1.2 = 1.67 > 1.5: divided, not subtracted
    assert greedy(row, prompt=[0], output=[1], repetition_penalty=2.0) == 2  # output tokens count too
    assert greedy(row, prompt=[0], repetition_penalty=2.0) == 1  # unseen tokens are untouched


def test_repetition_penalty_multiplies_negative_logits_of_seen_tokens():
    row = penalty_row(t3=-1.0, t4=-1.5)
    assert greedy(row, prompt=[3]) == 3
    assert greedy(row, prompt=[3], repetition_penalty=2.0) == 4  # -1.0 * 2 = -2.0 < -1.5
    assert greedy(row, prompt=[3], repetition_penalty=1.4) == 3  # -1.4 > -1.5
    assert greedy(row, prompt=[0], output=[3], repetition_penalty=2.0) == 4


def test_repetition_penalty_below_one_favours_seen_tokens():
    row = penalty_row(t1=1.0, t2=1.5)
    assert greedy(row, prompt=[1], repetition_penalty=0.5) == 1  # 1.0 / 0.5 = 2.0


def test_repetition_penalty_is_applied_once_per_token_however_often_it_was_seen():
    row = penalty_row(t1=2.0, t2=0.9)
    assert greedy(row, prompt=[1, 1, 1], output=[1, 1], repetition_penalty=2.0) == 1  # 1.0 > 0.9


def test_presence_penalty_is_additive_once_and_counts_only_output_tokens():
    row = penalty_row(t1=2.0, t2=1.5)
    assert greedy(row, output=[1], presence_penalty=0.6) == 2  # 1.4 < 1.5
    assert greedy(row, output=[1], presence_penalty=0.4) == 1  # 1.6
    assert greedy(row, output=[1, 1, 1], presence_penalty=0.4) == 1  # not scaled by the count
    assert greedy(row, prompt=[1, 1], presence_penalty=2.0) == 1  # prompt tokens are not penalized
    assert greedy(row, output=[2], presence_penalty=-1.0) == 2  # negative: encourages repeats


def test_frequency_penalty_scales_with_the_output_count():
    row = penalty_row(t1=2.0, t2=1.5)
    assert greedy(row, output=[1], frequency_penalty=0.2) == 1  # 1.8
    assert greedy(row, output=[1, 1, 1], frequency_penalty=0.2) == 2  # 1.4
    assert greedy(row, prompt=[1, 1, 1], frequency_penalty=2.0) == 1
    assert greedy(row, output=[1, 1], frequency_penalty=0.2, presence_penalty=0.2) == 2  # 2 - 0.4 - 0.2 = 1.4 < 1.5
    assert greedy(row, output=[1, 1], frequency_penalty=0.1, presence_penalty=0.2) == 1  # 2 - 0.2 - 0.2 = 1.6


def test_penalties_shape_the_sampled_distribution():
    row = ROW.clone()
    seq = make_seq(prompt=[1], output=[5, 5], repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25)
    expected = row.clone()
    expected[1] /= 1.5
    expected[5] = expected[5] / 1.5 - 2 * 0.5 - 0.25
    counts = draw(row, seq, n=4000)
    assert torch.allclose(freqs(counts), torch.softmax(expected, dim=-1), atol=0.035)


# min_new_tokens
def test_min_new_tokens_bars_eos_and_stop_ids_until_reached():
    row = penalty_row(t9=10.0, t5=9.0, t1=1.0)  # EOS best, stop id 5 second
    kw = dict(min_new_tokens=2, max_new_tokens=8, stop_token_ids=[5])
    assert greedy(row, output=[], **kw) == 1
    assert greedy(row, output=[1], **kw) == 1
    assert greedy(row, output=[1, 1], **kw) == EOS
    assert greedy(row, output=[], **{**kw, "min_new_tokens": 0}) == EOS


def test_min_new_tokens_holds_for_sampled_rows_too():
    row = penalty_row(t9=3.0, t5=3.0, t1=1.0, t2=1.0)
    counts = draw(row, make_seq(output=[1], min_new_tokens=3, max_new_tokens=8, stop_token_ids=[5]))
    assert set(counts) <= set(range(VOCAB)) - {5, EOS}
    counts = draw(row, make_seq(output=[1, 1, 1], min_new_tokens=3, max_new_tokens=8, stop_token_ids=[5]))
    assert counts[5] > 0 and counts[EOS] > 0


def test_min_new_tokens_only_bars_the_sequences_that_asked():
    row = penalty_row(t9=10.0, t1=1.0)
    seqs = [make_seq(temperature=0.0, min_new_tokens=1), make_seq(temperature=0.0)]
    tokens = [t for t, _ in Sampler({EOS})(row.expand(2, -1), seqs)]
    assert tokens == [1, EOS]


# seeds
FLAT = torch.zeros(VOCAB)


def run_stream(seq: Sequence, others: list[Sequence], position: int, sampler_seed: int, steps: int = 24) -> list[int]:
    """`seq`'s tokens over `steps` steps, batched at `position` among `others`; tokens are appended as the
    scheduler would."""
    sampler = Sampler({EOS}, seed=sampler_seed)
    for _ in range(steps):
        batch = others[:position] + [seq] + others[position:]
        results = sampler(FLAT.expand(len(batch), -1), batch)
        for s, (t, _) in zip(batch, results):
            s.output_ids.append(t)
    return seq.output_ids


def test_a_seeded_request_draws_the_same_tokens_whatever_it_is_batched_with():
    alone = run_stream(make_seq(seed=7), [], 0, sampler_seed=0)
    crowd = [make_seq(), make_seq(seed=3), make_seq(temperature=0.0), make_seq(top_k=2)]
    batched = run_stream(make_seq(seed=7), crowd, 2, sampler_seed=123)
    assert batched == alone
    assert len(set(alone)) > 3  # a real random stream, not a constant


def test_different_sample_index_gives_a_different_stream():
    first = run_stream(make_seq(seed=7, sample_index=0), [], 0, sampler_seed=0)
    second = run_stream(make_seq(seed=7, sample_index=1), [], 0, sampler_seed=0)
    again = run_stream(make_seq(seed=7, sample_index=1), [make_seq()], 1, sampler_seed=5)
    assert first != second
    assert second == again


def test_different_seeds_give_different_streams():
    assert run_stream(make_seq(seed=1), [], 0, 0) != run_stream(make_seq(seed=1000), [], 0, 0)


def test_unseeded_requests_follow_the_sampler_seed():
    a = run_stream(make_seq(), [], 0, sampler_seed=4)
    b = run_stream(make_seq(), [], 0, sampler_seed=4)
    c = run_stream(make_seq(), [], 0, sampler_seed=5)
    assert a == b and a != c


# logprobs
def test_logprobs_are_those_of_the_unprocessed_distribution():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(9)) * 2
    raw = torch.log_softmax(logits, dim=-1)
    seqs = [
        make_seq(prompt=[1, 2], output=[3], logprobs=3, temperature=0.5, top_k=4, repetition_penalty=1.8,
                 presence_penalty=1.0),
        make_seq(logprobs=0, temperature=0.0, min_new_tokens=2, max_new_tokens=4),
        make_seq(logprobs=5, top_p=0.5, min_p=0.1),
    ]
    for step in range(20):
        results = Sampler({EOS}, seed=step)(logits, seqs)
        for i, (token, lp) in enumerate(results):
            assert lp.token_id == token
            assert lp.logprob == pytest.approx(float(raw[i, token]), abs=1e-5)
        assert results[1][1].top == []
        for i, k in ((0, 3), (2, 5)):
            top = results[i][1].top
            assert len(top) == k
            values = [v for _, v in top]
            assert values == sorted(values, reverse=True)
            expect = raw[i].topk(k)
            assert [t for t, _ in top] == expect.indices.tolist()
            assert values == pytest.approx(expect.values.tolist(), abs=1e-5)


def test_logprobs_of_a_barred_or_penalized_token_stay_finite():
    row = penalty_row(t9=10.0, t1=1.0)
    seq = make_seq(prompt=[1], temperature=0.0, min_new_tokens=1, repetition_penalty=3.0, logprobs=2)
    (token, lp), = Sampler({EOS})(row[None], [seq])
    raw = torch.log_softmax(row, dim=-1)
    assert token == 1 and lp.logprob == pytest.approx(float(raw[1]), abs=1e-5)
    assert lp.top[0][0] == EOS and math.isfinite(lp.top[0][1])  # EOS is barred from sampling, not from the report


def test_no_logprobs_unless_asked():
    seqs = [make_seq(), make_seq(logprobs=1), make_seq(temperature=0.0)]
    results = Sampler({EOS})(torch.randn(3, VOCAB), seqs)
    assert results[0][1] is None and results[2][1] is None
    assert results[1][1] is not None and len(results[1][1].top) == 1


def test_half_precision_logits_are_sampled_in_float32():
    row = ROW.to(torch.bfloat16)
    (token, lp), = Sampler({EOS})(row[None], [make_seq(temperature=0.0, logprobs=0)])
    assert token == 1
    assert lp.logprob == pytest.approx(float(torch.log_softmax(row.float(), dim=-1)[1]), abs=1e-5)


# logit_bias (OpenAI's): added to the rows that have one, before greedy or sampling
def test_logit_bias_forces_bans_and_leaves_other_rows_alone():
    rows = ROW.expand(3, -1).clone()
    seqs = [make_seq(temperature=0.0, logit_bias={8: 100.0}), make_seq(temperature=0.0, logit_bias={1: -100.0}),
            make_seq(temperature=0.0)]
    tokens = [t for t, _ in Sampler({EOS})(rows, seqs)]
    assert tokens == [8, 5, 1]  # +100 forces the least likely token; -100 bans the argmax; no bias: the argmax


def test_a_banned_token_is_never_drawn_and_logprobs_stay_the_models():
    seq = make_seq(temperature=1.0, logit_bias={1: -100.0, 5: -100.0}, logprobs=0)
    counts = draw(ROW, seq, n=500)
    assert counts[1] == 0 and counts[5] == 0
    (token, lp), = Sampler({EOS})(ROW.unsqueeze(0), [make_seq(temperature=0.0, logit_bias={8: 100.0}, logprobs=0)])
    assert token == 8 and lp.logprob == pytest.approx(float(torch.log_softmax(ROW, -1)[8]))


def test_a_bias_out_of_range_names_logit_bias():
    from mlc.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(logit_bias={3: 150.0})
    assert e.value.field == "logit_bias"
