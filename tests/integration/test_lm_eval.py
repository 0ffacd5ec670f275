"""lm-evaluation-harness through the server: `lm_eval --model local-completions` scores a local multiple-choice
task against `mlc-cli serve` (echo + logprobs), and `mlc-cli eval --tasks` scores the same task in-process to the
same accuracies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.server_process import MODEL, ServerProcess

TASK = Path(__file__).resolve().parents[2] / "data" / "eval" / "capitals.yaml"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _scores(results: dict) -> dict[str, float]:
    metrics = results["results"]["mlc_capitals"]
    return {k: v for k, v in metrics.items() if k in ("acc,none", "acc_norm,none")}


@pytest.mark.slow
def test_local_completions_through_the_server_scores_like_mlc_eval(tmp_path):
    from mlc.models.store import pull

    tokenizer = pull(MODEL).path
    srv = ServerProcess(tmp_path, ["--max-batch-size", "4", "--max-seq-len", "1024"])
    out = tmp_path / "served"
    try:
        srv.wait_healthy()
        args = (f"model={MODEL},base_url={srv.url}/v1/completions,tokenizer={tokenizer},"
                "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1")
        cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
               "--include_path", ".", "--tasks", "mlc_capitals", "--output_path", str(out)]
        proc = subprocess.run(cmd, cwd=TASK.parent, env=ENV, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
    finally:
        srv.terminate()
    served = _scores(json.loads(next(out.rglob("results_*.json")).read_text()))
    local = subprocess.run([sys.executable, "-m", "mlc.cli.main", "eval", "--model", MODEL, "--tasks", str(TASK),
                            "--json"], env=ENV, capture_output=True, text=True, timeout=600)
    assert local.returncode == 0, local.stderr[-4000:]
    in_process = json.loads(local.stdout[local.stdout.index("{"):])["mlc_capitals"]
    assert served and served == {k: in_process[k] for k in served}
    assert served["acc,none"] >= 0.8  # the default model knows its capitals
