"""`bench train` on a tiny Llama for a few steps (the speed and memory figures come from the full command on the
default model, not from here): both sides train from the same adapter init on the same batches with the same
optimizer and schedule, so their losses agree step by step; each side reports its tokens, seconds and RSS."""

from __future__ import annotations

import json

import pytest

from mlc.bench.train_compare import TrainBenchConfig, plot, run_train_bench
from tests.support.tiny_llama import build_tiny_llama


@pytest.mark.slow
def test_ours_and_transformers_trainer_walk_the_same_loss_curve(tmp_path):
    model = build_tiny_llama(tmp_path / "llama")
    rows = [{"instruction": f"Question {i} about my order?", "output": f"Answer {i}: it ships in {i % 5 + 1} days."}
            for i in range(24)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = TrainBenchConfig(out_dir=tmp_path / "bench", model=str(model), data=str(tmp_path / "train.jsonl"), steps=6,
                           overrides={"precision": "fp32", "optimizer.lr": 1e-2, "lr_schedule.warmup_steps": 2,
                                      "max_seq_len": 64})
    result = run_train_bench(cfg, progress=print)
    assert result["steps_compared"] == 6 and result["max_loss_diff"] < 1e-4, result["max_loss_diff"]
    losses = [s["loss"] for s in result["runs"]["mlc"][0]["steps"]]
    assert losses[-1] < losses[0]  # it trains
    for side in ("mlc", "hf"):
        summary = result["per_round"][side][0]
        assert summary["tokens_per_s"] > 0 and summary["process_peak_mib"] > 100
        assert all(s["tokens"] > 0 and s["rss_kib"] > 0 for s in result["runs"][side][0]["steps"])
    assert result["speed_ratio"] > 0 and result["peak_rss_ratio"] > 0
    assert plot(result, tmp_path / "train.png").stat().st_size > 10_000
