"""A serving replica split over two Ray nodes: `mlc-cli deploy` with pipeline_parallel_size 2 and
tensor_parallel_size 2 on a cluster of two nodes (both on this machine's loopback, two inference devices each, so
that each stage's bundle fills a node and stage 1 must go to the node that does not hold the replica). The
endpoint's greedy tokens are one process's; `deploy status` shows where each rank runs; a rank killed fails the
replica's health check, Serve starts a new one (with a new placement group), and the endpoint answers again with
the same tokens."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.integration.test_cluster import ENV, cli, ok
from tests.support.server_process import free_port
from tests.support.tiny_llama import build_tiny_llama

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Hello, thank you for contacting us.", "Where is my refund? 0123"]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def two_nodes():
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.loopback_cluster", "2", "2", "2"], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)
    assert proc.stdout is not None and proc.stdin is not None
    line = proc.stdout.readline()
    assert line, "the two-node Ray cluster did not start"
    try:
        yield json.loads(line)["address"]
    finally:
        proc.stdin.close()
        proc.wait(timeout=120)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def deployed(two_nodes, model, tmp_path_factory):
    root = tmp_path_factory.mktemp("pp-cluster")
    port = free_port()
    (root / "serve.yaml").write_text(yaml.safe_dump({"engine": {"dtype": "fp32", "kv_cache_memory": "4MiB",
                                                                "max_seq_len": 128}}))
    config = root / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(model), "hardware": "cpu", "ray_address": two_nodes, "nodes": ["node-a", "node-b"],
        "devices_per_node": 2, "pipeline_parallel_size": 2, "tensor_parallel_size": 2, "port": port,
        "serve_config": "serve.yaml", "serving": {"cpus_per_replica": 2, "health_check_period_s": 2}}))
    env = {"MLC_HOME": str(root / "mlc-home")}
    try:
        result = ok(cli("deploy", "--cluster-config", str(config), env=env))
        assert "2 pipeline stages, 2 devices of one node each" in result and "2 nodes or more" in result
        yield config, f"http://127.0.0.1:{port}", env
    finally:
        down = cli("deploy", "down", "--cluster-config", str(config), env=env, timeout=180)
        assert down.returncode == 0, down.stdout + down.stderr


def status(config: Path, env: dict) -> dict:
    return json.loads(ok(cli("deploy", "status", "--cluster-config", str(config), "--json", env=env)))


def endpoint_tokens(url: str) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        r = httpx.post(url + "/generate", json={"prompt": prompt, "max_new_tokens": NEW_TOKENS, "temperature": 0},
                       timeout=120)
        assert r.status_code == 200, r.text
        out.append(r.json()["tokens"])
    return out


@pytest.fixture(scope="module")
def one_process(model) -> list[list[int]]:
    from mlc.engine.llm import LLM
    from mlc.engine.sampling_params import SamplingParams

    llm = LLM(str(model), dtype="fp32", kv_cache_memory="4MiB", max_seq_len=128)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(t) == NEW_TOKENS for t in tokens)  # no early end of sequence: every step is compared
    return tokens


def healthy_replica(config: Path, env: dict) -> dict:
    replicas = [r for r in status(config, env)["replicas"] if r["health"] == "healthy"]
    assert len(replicas) == 1, replicas
    return replicas[0]


def check_layout(replica: dict) -> None:
    """Ranks 1..3: rank 1 is stage 0's second TP rank (beside the replica), ranks 2 and 3 stage 1 (the other node)."""
    ranks = {s["rank"]: s for s in replica["stages"]}
    assert sorted(ranks) == [1, 2, 3] and [ranks[r]["stage"] for r in (1, 2, 3)] == [0, 1, 1]
    assert ranks[1]["node_id"] == replica["node_id"]
    assert ranks[2]["node_id"] == ranks[3]["node_id"] != replica["node_id"]


def test_the_stages_run_on_two_nodes_and_answer_as_one_process(deployed, one_process):
    config, url, env = deployed
    check_layout(healthy_replica(config, env))
    assert endpoint_tokens(url) == one_process


def test_a_killed_rank_brings_a_new_replica_that_answers_the_same(deployed, one_process):
    config, url, env = deployed
    before = healthy_replica(config, env)
    pid = next(s["pid"] for s in before["stages"] if s["rank"] == 3)
    os.kill(pid, signal.SIGKILL)  # both nodes are this machine: the pid is ours to kill
    r = httpx.post(url + "/generate", json={"prompt": PROMPTS[0], "max_new_tokens": 4, "temperature": 0},
                   timeout=120)
    # the broken replica answers an error (or a new one already answers), never a wrong answer
    assert r.status_code >= 500 or r.json()["tokens"] == one_process[0][:4], r.text
    deadline = time.monotonic() + 300
    while True:
        replicas = [r for r in status(config, env)["replicas"] if r["health"] == "healthy"]
        if replicas and replicas[0]["id"] != before["id"] and len(replicas[0]["stages"]) == 3:
            break
        assert time.monotonic() < deadline, f"no new replica within 300 s: {replicas}"
        time.sleep(3)
    check_layout(replicas[0])
    assert endpoint_tokens(url) == one_process
