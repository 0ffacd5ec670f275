"""`bench soak` for ten minutes against `mlc-cli serve` on its defaults (issue 33's short version): the whole mix
with its injected faults at 70% of the saturation it measures first, and every invariant but the latency drift
held as the command checks them (ten minutes give the first and last tenth about a minute each: their p99s are
compared with a 100% allowance here, 20% in the hour-long run)."""

from __future__ import annotations

import pytest

from mlc.bench.soak import SoakConfig, run_soak


@pytest.mark.slow
def test_ten_minutes_of_mixed_traffic_hold_the_invariants(tmp_path):
    cfg = SoakConfig(out_dir=tmp_path, duration_s=600, sample_s=5, max_latency_drift=1.0)
    result, ok = run_soak(cfg, progress=print)
    failed = [inv for inv in result["invariants"] if inv["ok"] is False]
    assert ok and not failed, failed
    kinds = {o["kind"] for o in result["outcomes"]}
    assert {"chat_stream", "tools", "json_schema", "n2", "echo", "long", "abort", "malformed"} <= kinds
    assert (tmp_path / "soak.png").stat().st_size > 10_000 and (tmp_path / "soak.md").is_file()
