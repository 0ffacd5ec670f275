"""Percentiles and the bench serve report computed from per-request results."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from mlc.bench.serve import BenchConfig, RequestResult, base_url, load_prompts, report
from mlc.bench.stats import percentile, summarize
from mlc.errors import DataError, InvalidRequestError


@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0], [5, 1, 4, 2, 3], list(np.random.default_rng(0).random(101))])
@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 100])
def test_percentile_matches_numpy(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edges():
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summary_scales_and_serializes():
    s = summarize([0.1, 0.2, 0.3]).scaled(1000)
    assert s.count == 3 and s.mean == pytest.approx(200) and s.p50 == pytest.approx(200) and s.max == pytest.approx(300)
    assert summarize([]).as_dict()["mean"] is None
    json.dumps(summarize([]).as_dict())


def ok(ttft, e2e, tokens):
    itl = [(e2e - ttft) / (tokens - 1)] * (tokens - 1)
    return RequestResult(True, e2e, ttft, itl, tokens, 10)


def test_report_counts_goodput_and_failures():
    cfg = BenchConfig(url="http://x", concurrency=[2], num_prompts=4, slo_ttft_ms=100, slo_tpot_ms=50)
    results = [ok(0.05, 0.5, 11), ok(0.2, 0.6, 11), ok(0.05, 1.05, 11),
               RequestResult(False, 0.1, error="HTTP 200 with an empty completion")]
    rep = report(2, results, duration=2.0, cfg=cfg)
    assert (rep.completed, rep.failed) == (3, 1)
    assert rep.output_tokens == 33 and rep.output_tok_s == pytest.approx(16.5)
    assert rep.request_throughput == pytest.approx(1.5)
    assert rep.goodput == pytest.approx(0.5)  # only the first meets TTFT <= 100 ms and TPOT <= 50 ms
    assert rep.tpot_ms.p50 == pytest.approx(45.0)
    assert rep.errors == ["HTTP 200 with an empty completion"]
    assert report(2, results, 2.0, BenchConfig(url="http://x", concurrency=[2], num_prompts=4)).goodput is None


def test_prompts_from_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n\n{"messages": [{"role": "user", "content": "yo"}]}\n')
    assert load_prompts(str(path)) == [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]]
    assert len(load_prompts("builtin")) >= 20
    path.write_text('{"text": "hi"}\n')
    with pytest.raises(DataError):
        load_prompts(str(path))


def test_base_url():
    assert base_url("http://127.0.0.1:8080/v1/") == "http://127.0.0.1:8080"
    with pytest.raises(InvalidRequestError):
        base_url("127.0.0.1:8080")
