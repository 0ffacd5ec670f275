"""`bench soak`'s verdict (`bench/soak_report.py`) on made-up runs: each invariant held, violated, or not
decidable; the request mix (`bench/soak_mix.py`) builds every kind's body."""

from __future__ import annotations

import random
from types import SimpleNamespace

from mlc.bench.soak_mix import INJECTED, WEIGHTS, MixContext, body_for
from mlc.bench.soak_report import check, markdown, plot

CFG = SimpleNamespace(warmup=10.0, max_rss_growth=0.05, max_latency_drift=0.2, max_crowd_slowdown=0.2, sample_s=5.0)


def _sample(t: float, rss: float, ttft: list[float], fds=20.0, threads=8.0, tasks=10.0, kv=0.1, running=2.0):
    return {"t": t, "rss_bytes": rss, "kv_usage": kv, "running": running, "waiting": 0.0, "open_fds": fds,
            "threads": threads, "asyncio_tasks": tasks, "finished": len(ttft), "ttft_s": ttft,
            "tpot_s": [0.05] * len(ttft)}


def _outcome(kind: str, status: int) -> dict:
    return {"kind": kind, "start": 0.0, "status": status, "e2e": 1.0, "ttft": 0.1, "tpot": 0.05, "tokens": 8,
            "error": None if status == 200 else "x", "injected": kind in INJECTED}


def run(rss_end: float = 1.02e9, last_ttft: float = 0.11, end_kv: float = 0.0, status: int = 200) -> dict:
    samples = [_sample(0.0, 0.95e9, [])] + [_sample(10.0 + 5 * i, 1.0e9 + i * (rss_end - 1.0e9) / 19,
                                                    [0.1] * 30 if i < 4 else [last_ttft] * 30) for i in range(20)]
    end = {**_sample(120.0, rss_end, []), "kv_usage": end_kv, "running": 0.0}
    outcomes = [_outcome("chat", status)] * 50 + [_outcome("malformed", 400)] * 3 + [_outcome("abort", 0)] * 2
    return {"samples": samples, "end": end, "outcomes": outcomes, "t0": 100.0, "server_started": 30.0,
            "rate": 1.0, "saturation": 1.4, "config": {"duration_s": 120.0, "load": 0.7},
            "machine": {"cpu": "a CPU", "cores": 2, "time": "now"}}


def verdict(result: dict) -> dict[str, bool | None]:
    return {inv["name"].split(" (")[0]: inv["ok"] for inv in check(result, CFG)}


def test_a_clean_run_holds_every_invariant():
    v = verdict(run())
    assert v["no 5xx or dropped connection outside the injected faults"] is True  # the aborts are injected
    assert v["malformed requests answered 4xx"] is True
    assert v["no KV page or request left once the traffic stops"] is True
    assert v["RSS growth after warm-up <= 5%"] is True
    assert v["RSS at the first sample"] is True  # 70 s after start, 95% of the peak
    assert v["open_fds flat"] and v["threads flat"] and v["asyncio_tasks flat"]
    assert v["p99 TTFT in the last window within 20% of the first"] is True


def test_creep_leaks_5xx_and_drift_are_each_named():
    v = verdict(run(rss_end=1.1e9))
    assert v["RSS growth after warm-up <= 5%"] is False
    assert verdict(run(end_kv=0.02))["no KV page or request left once the traffic stops"] is False
    assert verdict(run(status=503))["no 5xx or dropped connection outside the injected faults"] is False
    assert verdict(run(last_ttft=0.2))["p99 TTFT in the last window within 20% of the first"] is False


def test_a_crowd_that_joins_mid_run_is_judged_against_the_mix_before_it():
    beside = "p99 TTFT beside the crowd within 20% of before it"
    assert beside not in verdict(run())  # a crowd from the start (or none): nothing to compare with
    result = run()
    result["crowd_started"] = 40.0  # samples every 5 s from 10 s to 105 s: before it 10-40 s, beside it 105 s
    assert verdict(result)[beside] is True
    for s in result["samples"]:
        if s["t"] > 40.0 + 60.0:
            s["ttft_s"] = [0.1] * 29 + [0.2]  # one slow request in thirty
    assert verdict(result)[beside] is False
    for s in result["samples"]:
        if s["t"] > 40.0 + 60.0:
            s["ttft_s"] = [0.11] * 30
        elif s["t"] > 40.0:
            s["ttft_s"] = [5.0] * 30  # the minute in which the crowd settles is not counted
    assert verdict(result)[beside] is True


def test_a_short_run_says_what_it_cannot_tell(tmp_path):
    result = run()
    for s in result["samples"]:
        s["ttft_s"] = s["tpot_s"] = []
    v = verdict(result)
    drift = "p99 {} in the last window within 20% of the first"
    assert v[drift.format("TTFT")] is None and v[drift.format("TPOT")] is None
    result["invariants"] = check(result, CFG)
    table = markdown(result)
    assert f"| {drift.format('TTFT')} | - | too few requests (0 first, 0 last) |" in table
    assert "| malformed | 400 | 3 |" in table
    assert plot(result, tmp_path / "soak.png").stat().st_size > 10_000


def test_every_kind_of_the_mix_has_a_body():
    ctx = MixContext(model="m", context=8192, shared_system="s" * 100, long_text="t" * 100, lora="support")
    rng = random.Random(0)
    for kind in WEIGHTS:
        path, body = body_for(kind, ctx, rng)
        assert path.startswith("/v1/") and body["model"] in ("m", "support")
    assert {ctx.choose(rng) for _ in range(2000)} == set(WEIGHTS)  # lora only when the server has one
    assert "lora" not in {MixContext("m", 1, "", "").choose(rng) for _ in range(2000)}
