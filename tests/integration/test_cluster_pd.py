"""Prefill/decode disaggregation through `mlc-cli deploy`: a cluster file with `pools: {prefill, decode}` and `pd:`
starts a prefill replica and a decode replica of the default model on a local Ray head (loopback); the endpoint sends
a long prompt to the prefill replica first and the decode replica pulls its KV pages over the prefill replica's side
channel. Greedy tokens are one process's, long prompt or short; the gateway's metrics count the routes and the
decode replica's the pages received; a client's own KV handle header is dropped; `deploy status` shows each
replica's role."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
import yaml

from tests.integration.test_cluster import cli, ok
from tests.support.server_process import MODEL, free_port

pytestmark = pytest.mark.slow

LONG = ("The river flows from the mountains in the north, through three old towns and a wide green valley, past farms, "
        "mills and bridges, until at last it reaches the sea. Along the way it")  # 12 tokens on, no early end
SHORT = "Hi!"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    from mlc.models.store import resolve_model_dir

    root = tmp_path_factory.mktemp("pd-cluster")
    port = free_port()
    (root / "serve.yaml").write_text(yaml.safe_dump({"engine": {"kv_cache_memory": "32MiB", "max_seq_len": 512}}))
    config = root / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(resolve_model_dir(MODEL)), "hardware": "cpu", "ray_address": f"local:{free_port()}",
        "nodes": ["localhost"], "devices_per_node": 2, "port": port, "serve_config": "serve.yaml",
        "pools": {"prefill": [{"host": "localhost", "devices": [0]}],
                  "decode": [{"host": "localhost", "devices": [1]}]},
        "pd": {"threshold_tokens": 16}, "serving": {"cpus_per_replica": 0.5}}))
    env = {"MLC_HOME": str(root / "mlc-home")}
    try:
        result = cli("deploy", "--cluster-config", str(config), env=env)
        ok(result)
        assert "replicas (1 prefill, 1 decode)" in result.stderr
        yield config, f"http://127.0.0.1:{port}", env
    finally:
        down = cli("deploy", "down", "--cluster-config", str(config), env=env, timeout=180)
        assert down.returncode == 0, down.stdout + down.stderr


@pytest.fixture(scope="module")
def one_process() -> dict[str, list[int]]:
    from mlc.engine.llm import LLM
    from mlc.engine.sampling_params import SamplingParams

    llm = LLM(MODEL, kv_cache_memory="32MiB", max_seq_len=512)
    outs = llm.generate([LONG, SHORT], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    tokens = {LONG: list(outs[0].outputs[0].token_ids), SHORT: list(outs[1].outputs[0].token_ids)}
    assert len(tokens[LONG]) == NEW_TOKENS  # the decode replica continues past the prefill's first token
    return tokens


def generate(url: str, prompt: str, **headers: str) -> list[int]:
    r = httpx.post(url + "/generate", json={"prompt": prompt, "max_new_tokens": NEW_TOKENS, "temperature": 0},
                   headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_a_long_prompt_prefills_on_the_prefill_replica_and_decodes_the_same_tokens(deployed, one_process):
    config, url, env = deployed
    assert generate(url, LONG) == one_process[LONG]
    assert generate(url, SHORT) == one_process[SHORT]
    deadline = time.monotonic() + 15  # replicas post their metrics to the gateway every second
    while True:
        text = httpx.get(url + "/metrics", timeout=30).text
        if metric(text, "mlc:kv_transfer_received_bytes_total") > 0 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert 'mlc:pd_requests_total{route="remote"} 1' in text and 'mlc:pd_requests_total{route="local"} 1' in text
    kv = "\n".join(line for line in text.splitlines() if "kv_transfer" in line or "kv_lease" in line)
    assert metric(text, "mlc:kv_transfer_received_bytes_total") > 0, kv  # the pages came over the side channel
    assert metric(text, "mlc:kv_transfer_imports_total") == 1 and metric(text, "mlc:kv_transfer_recomputed_total") == 0


def test_a_clients_own_kv_handle_is_dropped(deployed, one_process):
    config, url, env = deployed
    forged = "eyJyZXF1ZXN0X2lkIjogIngifQ=="  # base64 of {"request_id": "x"}: a handle the gateway did not make
    assert generate(url, SHORT, **{"x-mlc-kv-handle": forged}) == one_process[SHORT]


def test_status_shows_each_replicas_role_and_the_pools_queues(deployed):
    config, url, env = deployed
    report = json.loads(ok(cli("deploy", "status", "--cluster-config", str(config), "--json", env=env)))
    assert sorted(r["role"] for r in report["replicas"]) == ["decode", "prefill"]
    assert set(report["pools"]) == {"prefill", "decode"}
    assert set(report["applications"]) == {"mlc", "mlc-prefill", "mlc-decode"}
