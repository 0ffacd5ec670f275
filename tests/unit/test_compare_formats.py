"""`bench compare --formats`' summary (`bench/compare_formats.py`): the ratios taken from one compare run, and the
formats table rendered from a stored run (docs/bench/formats-1b.json, the figures BENCHMARKS.md quotes)."""

from __future__ import annotations

import json
from pathlib import Path

from mlc.bench.compare_formats import markdown, ratios

RUN = Path(__file__).resolve().parents[2] / "docs" / "bench" / "formats-1b.json"


def _level(c: int, tok_s: float, tpot: float, ttft: float) -> dict:
    return {"concurrency": c, "output_tok_s": tok_s, "tpot_ms": {"p50": tpot}, "ttft_ms": {"p50": ttft}}


def test_ratios_pair_ours_with_the_peer_per_level():
    result = {"servers": {"mlc": {}, "llama": {}}, "workloads": {
        "concurrency": {"mlc": [_level(1, 20.0, 50.0, 100.0), _level(8, 80.0, 90.0, 400.0)],
                        "llama": [_level(1, 10.0, 100.0, 150.0), _level(8, 40.0, 180.0, 600.0)]},
        "prefill": {"mlc": {"prompt_tok_s": 150.0}, "llama": {"prompt_tok_s": 100.0}}}}
    got = ratios(result)
    assert got["tok_s"] == {1: [20.0, 10.0], 8: [80.0, 40.0]} and got["peer"] == "llama"
    assert got["tpot_ms_c1"] == [50.0, 100.0] and got["ttft_ms_c1"] == [100.0, 150.0]
    assert got["prefill_tok_s"] == [150.0, 100.0]
    assert ratios({"servers": {"mlc": {}}, "workloads": {}}) == {"note": "llama.cpp did not run"}


def test_the_table_shows_each_formats_ratios_bandwidth_and_latency():
    table = markdown(json.loads(RUN.read_text()))
    row = next(line for line in table.splitlines() if line.startswith("| Q4_0 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:5] == ["Q4_0", "Q4_0 (112 Q4_0, 1 Q6_K)", "1.61x (20.8 / 12.9)", "1.89x (78.0 / 41.2)",
                         "1.68x (89.1 / 53.1)"]
    # 763 MB a token over TPOT, against the run's 19.9 GB/s; TTFT as llama.cpp's time over ours
    assert cells[5:9] == ["46.5 / 75.9", "83% / 51%", "1.20x", "1.58x"] and cells[9] == "-"
    assert "memory read bandwidth 19.9 GB/s" in table and "of MoE experts, the routed share" in table
