"""The JSON behind the web UI: the dashboard's latency window and per-second history, the training view's reading of
a run directory, and the `train --ui` app (in-process, no model)."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
from fastapi.testclient import TestClient

from mlc.engine.outputs import EngineStats
from mlc.errors import ConfigError, DataError
from mlc.server.observability.metrics_history import LatencyWindow, MetricsHistory, percentile
from mlc.train.logging import TrainLog
from mlc.train.run_view import read_run
from mlc.train.ui import TrainUI, build_app


def stats(generated: int, prompt: int, hits: int = 0, queries: int = 0, running: int = 0) -> EngineStats:
    return EngineStats(num_running=running, num_waiting=0, kv_cache_usage=0.25, num_free_pages=30, num_pages=40,
                       prefix_cache_queries=queries, prefix_cache_hits=hits, num_preemptions=0, prompt_tokens=prompt,
                       generation_tokens=generated)


def test_percentiles_interpolate_between_ranks():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 90) == pytest.approx(90.0)


def test_latency_window_keeps_recent_requests_and_a_total():
    window = LatencyWindow()
    for k in range(4):
        window.add(ttft=0.1 * (k + 1), tpot=0.02, e2e=1.0, output_tokens=10)
    window.recent[0].time -= 400  # finished long ago: outside every window
    got = window.stats(300)
    assert window.total == 4 and got["requests"] == 3
    assert got["ttft_s"]["p50"] == pytest.approx(0.3) and got["tpot_s"]["p99"] == pytest.approx(0.02)


def test_history_rates_come_from_counter_differences():
    current = {"s": stats(0, 0)}
    history = MetricsHistory(lambda: current["s"], lambda: 2, LatencyWindow())
    first = history.sample()
    assert first["generation_tps"] is None and first["waiting"] == 2 and first["kv_cache_usage"] == 0.25
    history._last = (history._last[0] - 2.0, history._last[1])  # pretend the last sample was 2 s ago
    current["s"] = stats(generated=100, prompt=40, hits=3, queries=4, running=3)
    second = history.sample()
    assert second["generation_tps"] == pytest.approx(50, rel=0.05)
    assert second["prompt_tps"] == pytest.approx(20, rel=0.05)
    assert second["prefix_hit_rate"] == 0.75 and second["running"] == 3
    assert history.since(first["t"]) == [second] and len(history.since(None)) == 2


def write_run(path, steps: int, every_eval: int = 5, max_steps: int | None = None, epochs: float | None = None):
    path.mkdir(parents=True, exist_ok=True)
    config = {"model": "tiny", "max_steps": max_steps, "epochs": epochs, "batch_size": 4, "optimizer": {"lr": 2e-4}}
    (path / "train_config.json").write_text(json.dumps(config))
    log = TrainLog(path)
    for step in range(1, steps + 1):
        bad = step == 3
        log.append({"step": step, "epoch": step / 10, "loss": float("inf") if bad else 2.0 / step, "lr": 1e-4,
                    "grad_norm": float("nan") if bad else 0.5, "tokens": 200, "tokens_per_s": 1000.0, "skipped": bad})
        if step % every_eval == 0:
            log.append({"step": step, "eval_loss": 1.0 / step, "eval_ppl": 2.0})
    return path


def test_a_running_run_reports_progress_eta_and_skipped_steps(tmp_path):
    run = write_run(tmp_path / "run", steps=6, max_steps=20)
    started = time.time() - 12  # the process started 12 s before its last log line: 2 s per step
    os.utime(run / "train_config.json", (started, started))
    got = read_run(str(run))
    assert got["status"] == "running" and got["step"] == 6 and got["total_steps"] == 20
    assert got["seconds_per_step"] == pytest.approx(2.0, rel=0.1) and got["eta_s"] == pytest.approx(28, rel=0.1)
    assert got["skipped_total"] == 1 and got["steps"][2]["loss"] is None and got["steps"][2]["skipped"]
    assert got["last"]["loss"] == pytest.approx(2.0 / 6)
    assert got["evals"] == [{"step": 5, "eval_loss": 0.2, "eval_ppl": 2.0}]
    assert got["config"]["lr"] == 2e-4 and got["checkpoints"] == [] and got["summary"] is None


def test_total_steps_from_epochs_and_a_finished_run(tmp_path):
    run = write_run(tmp_path / "run", steps=15, epochs=1.5)
    assert read_run(str(run))["total_steps"] == 15  # the log's epoch says 10 steps per epoch
    (run / "summary.json").write_text(json.dumps({"steps": 15, "train_loss": 0.1}))
    got = read_run(str(run))
    assert got["status"] == "finished" and got["eta_s"] is None and got["summary"]["train_loss"] == 0.1
    old = time.time() - 3600
    (run / "summary.json").unlink()
    for name in ("train_log.jsonl", "train_config.json"):
        os.utime(run / name, (old, old))
    assert read_run(str(run))["status"] == "stopped"


def test_a_half_written_last_line_is_skipped(tmp_path):
    run = write_run(tmp_path / "run", steps=2, max_steps=5)
    with (run / "train_log.jsonl").open("a") as f:
        f.write('{"step": 3, "loss": 0.')
    assert read_run(str(run))["step"] == 2


@pytest.mark.parametrize("bad", ["", "/", "no/such/dir", "a\x00b", "x" * 5000])
def test_what_is_not_a_run_directory_is_a_clear_400(bad):
    with pytest.raises(DataError, match="not a training run directory") as e:
        read_run(bad)
    assert e.value.http_status == 400 and e.value.field == "dir"


def test_the_train_ui_app_serves_the_page_and_the_run(tmp_path):
    run = write_run(tmp_path / "run", steps=4, max_steps=8)
    client = TestClient(build_app(str(run)))
    root = client.get("/", follow_redirects=False)
    assert root.status_code == 307 and root.headers["location"].startswith("/train?run=")
    page = client.get("/train")
    assert page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]
    assert client.get("/static/train.js").status_code == 200
    assert client.get("/static/chat.js").status_code == 404  # only the training page's files
    assert client.get("/api/train/ui").json() == {"run": str(run)}
    assert client.get("/api/train/run", params={"dir": str(run)}).json()["step"] == 4
    missing = client.get("/api/train/run", params={"dir": str(tmp_path)})
    assert missing.status_code == 400 and "not a training run directory" in missing.json()["error"]["message"]
    assert client.get("/api/train/run").status_code == 400


def test_a_busy_ui_port_is_a_config_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with pytest.raises(ConfigError, match="--ui-port"):
            TrainUI(str(tmp_path), taken.getsockname()[1])
    ui = TrainUI(str(tmp_path), 0).start()
    try:
        import httpx

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if httpx.get(ui.url.replace("/train", "/api/train/ui"), timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        assert httpx.get(ui.url, timeout=2).status_code == 200
    finally:
        ui.stop()
