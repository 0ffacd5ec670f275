"""`bench compare` end to end on a tiny random model: our real server under every workload, the report files,
and transformers' continuous batching as the offline peer. (llama.cpp needs a GGUF: its skip note is checked.)"""

from __future__ import annotations

import json

import pytest

from mlc.bench.compare import CompareConfig
from mlc.bench.compare_run import run_compare
from mlc.bench.offline_cb import run_transformers_cb
from tests.support.tiny_llama import build_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("compare") / "model")


def test_compare_runs_every_workload_and_writes_the_report(tiny, tmp_path):
    out = tmp_path / "report"
    cfg = CompareConfig(model=str(tiny), out_dir=out, concurrency=[1, 2], num_prompts=3, max_tokens=4,
                        request_rate=20.0, prefill_tokens=96, shared_prefix_tokens=48, shared_requests=3,
                        build_llama=False, offline=False, ours_args=["--kv-cache-memory", "8MiB"])
    messages = []
    result = run_compare(cfg, progress=messages.append)
    ours = next(iter(result["servers"]))
    w = result["workloads"]
    levels = w["concurrency"][ours]
    assert [r["concurrency"] for r in levels] == [1, 2]
    for r in levels + [w["request_rate"][ours]]:
        assert (r["completed"], r["failed"]) == (3, 0), r["errors"]
        assert r["output_tokens"] == 3 * 4 and r["output_tok_s"] > 0 and len(r["samples_ms"]["e2e"]) == 3
    assert w["prefill"][ours]["prompt_tokens"] > 48 and w["prefill"][ours]["prompt_tok_s"] > 0
    shared = w["shared_prefix"][ours]
    assert shared["shared"]["completed"] == shared["unique"]["completed"] == 3 and shared["ttft_gain"] > 0
    assert any("llama.cpp skipped" in n for n in result["notes"])
    saved = json.loads((out / "compare.json").read_text())
    assert saved["workloads"]["concurrency"][ours][0]["completed"] == 3
    md = (out / "compare.md").read_text()
    assert "### Concurrency" in md and "### Long prompt prefill" in md and "prefix caching" in md
    for plot in result["plots"]:
        with open(plot, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert any("concurrency 2" in m for m in messages)


def test_transformers_continuous_batching_peer(tiny):
    ids = [[1, 5, 9, 12], [3, 4], [7, 8, 9]]
    r = run_transformers_cb(tiny, ids, 5)
    assert r["requests"] == 3 and r["output_tokens"] == 15 and r["tok_s"] > 0
