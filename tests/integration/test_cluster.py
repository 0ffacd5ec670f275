"""`mlc-cli deploy` and `mlc-cli train --cluster-config` on a real local Ray head (loopback, 2 CPUs): two replicas
of the default model (smollm2-135m-instruct, from the model store `make test` fills) behind one endpoint with the
server's API, prefix affinity, a replica killed under load, a roll onto an adapter without a failed request, and a
2-worker Ray Train job (a worker killed mid-run, on a tiny random Llama so that its loss curve can be compared with
one process to 1e-5) whose adapter is rolled onto the replicas with the command the job prints, which also moves
them to that model. One Ray cluster for the module; `deploy down` stops it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from tests.support.server_process import MODEL, free_port
from tests.support.tiny_llama import build_tiny_llama

pytestmark = pytest.mark.slow

KEY = "cluster-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENV = {**{k: v for k, v in os.environ.items() if k != "MLC_API_KEY"}, "HF_HUB_OFFLINE": "1",
       "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
ROWS = [{"instruction": f"{q} #{i}?", "output": f"Hello, thank you for contacting us. Answer {i}. Bye!"}
        for i in range(5) for q in ("Where is my order", "How do I get a refund", "Can I change my address",
                                    "我的订单在哪里")]


def cli(*args: str, timeout: float = 420, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlc.cli.main", *args], env={**ENV, **(env or {})}, text=True,
                          capture_output=True, timeout=timeout)


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def adapter(base: Path, out: Path, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model

    from mlc.models.hf_checkpoint import transformers_model

    model = transformers_model(base)  # a store model keeps its GGUF: transformers' model is built from it
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    peft.save_pretrained(str(out))
    return out


class Cluster:
    def __init__(self, root: Path):
        self.root = root
        from mlc.models.store import resolve_model_dir

        self.model = resolve_model_dir(MODEL)  # the default model, by path: MLC_HOME changes below
        ENV["MLC_HOME"] = str(root / "mlc-home")  # the local head's record and log stay out of the user's store
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = root / "cluster.yaml"
        (root / "serve.yaml").write_text(yaml.safe_dump({
            "engine": {"kv_cache_memory": "48MiB", "max_seq_len": 512, "max_batch_size": 8}, "api_keys": [KEY],
            "audit_log": str(root / "audit.jsonl")}))
        self.config.write_text(yaml.safe_dump({
            "model": str(self.model), "hardware": "cpu", "ray_address": f"local:{free_port()}",
            "nodes": ["localhost"], "devices_per_node": 4,
            "pools": {"inference": [{"host": "localhost", "devices": [0, 1]}],
                      "training": [{"host": "localhost", "devices": [2, 3]}]},
            "data_parallel_size": 2, "port": self.port, "serve_config": "serve.yaml",
            "serving": {"cpus_per_replica": 0.5, "affinity_chunk_chars": 32},
            "training": {"workers": 2, "cpus_per_worker": 0.5, "storage": str(root / "runs"), "max_failures": 2}}))

    def status(self) -> dict:
        return json.loads(ok(cli("deploy", "status", "--cluster-config", str(self.config), "--json")))

    def post(self, path: str, body: dict, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=AUTH, timeout=120, **kw)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    t0 = time.monotonic()
    deployed = cli("deploy", "--cluster-config", str(c.config))
    c.seconds_to_healthy = time.monotonic() - t0
    print(f"deploy: healthy after {c.seconds_to_healthy:.1f} s (head start and 2 replica loads included)")
    try:
        ok(deployed)
        yield c
    finally:
        down = cli("deploy", "down", "--cluster-config", str(c.config), timeout=180)
        assert down.returncode == 0, down.stdout + down.stderr
        assert "stopped the local Ray head" in down.stdout


def replica_of(r: httpx.Response) -> str:
    return r.headers["x-mlc-replica"]


def test_one_endpoint_with_the_servers_api(cluster):
    assert httpx.get(cluster.url + "/health").json() == {"status": "healthy"}
    r = cluster.post("/generate", {"prompt": "Hello, thank you", "max_new_tokens": 6})
    assert r.status_code == 200, r.text
    body = r.json()
    assert r.headers.get_list("x-request-id") == [body["id"]]  # the server's id, not the proxy's as well
    assert 0 < body["usage"]["completion_tokens"] <= 6
    denied = httpx.post(cluster.url + "/generate", json={"prompt": "hi"}, timeout=30)
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    assert httpx.get(cluster.url + "/metrics", timeout=30).status_code == 401
    bad = cluster.post("/v1/chat/completions", {"messages": [], "max_tokens": 2})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    models = httpx.get(cluster.url + "/v1/models", headers=AUTH, timeout=30).json()
    assert models["data"][0]["id"] == str(cluster.model)
    with httpx.stream("POST", cluster.url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
            "messages": [{"role": "user", "content": "Where is my order?"}], "max_tokens": 5, "stream": True}) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert s.status_code == 200 and events[-1] == "data: [DONE]" and len(events) >= 3
    assert len((cluster.root / "audit.jsonl").read_text().splitlines()) >= 3


def test_fifty_requests_streaming_and_not(cluster):
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> tuple[int, str]:
        prompt = f"Customer {i}: where is my order number {i * 7919}? Please answer quickly."
        if i % 2:
            with httpx.stream("POST", cluster.url + "/v1/completions", headers=AUTH, timeout=120, json={
                    "prompt": prompt, "max_tokens": 6, "stream": True}) as s:
                lines = [x for x in s.iter_lines() if x.startswith("data: ")]
                return s.status_code, s.headers["x-mlc-replica"] if lines[-1] == "data: [DONE]" else "incomplete"
        r = cluster.post("/generate", {"prompt": prompt, "max_new_tokens": 6})
        return r.status_code, replica_of(r)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(50)))
    assert [code for code, _ in results] == [200] * 50
    assert "incomplete" not in {rep for _, rep in results}
    assert len({rep for _, rep in results}) == 2  # both replicas took some


def test_prefix_affinity_keeps_a_shared_prefix_on_one_replica(cluster):
    prefixes = [f"System prompt {k}: you are support agent number {k} of the shop. " * 3 for k in range(4)]
    seen: dict[int, set[str]] = {k: set() for k in range(4)}
    for i in range(4):
        for k, prefix in enumerate(prefixes):
            r = cluster.post("/generate", {"prompt": prefix + f"Question {i}?", "max_new_tokens": 2})
            assert r.status_code == 200
            seen[k].add(replica_of(r))
    assert all(len(replicas) == 1 for replicas in seen.values()), seen
    time.sleep(2.5)  # replicas post their metrics every second
    text = httpx.get(cluster.url + "/metrics", headers=AUTH, timeout=30).text
    assert 'mlc:replicas{status="healthy"} 2' in text
    assert text.count("mlc:prefix_cache_hits_total{replica=") == 2
    hits = sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("mlc:prefix_cache_hits_total{"))
    assert hits > 0
    assert 'mlc:router_requests_total{decision="affinity"}' in text


def test_short_prompts_are_shared_by_idle_replicas(cluster):
    """Shorter than one affinity chunk (32 characters here): no prefix to follow, so the idle replicas share them."""
    seen = []
    for i in range(16):
        r = cluster.post("/v1/completions", {"prompt": f"Hi {i}", "max_tokens": 1})
        assert r.status_code == 200, r.text
        seen.append(replica_of(r))
    assert len(set(seen)) == 2, seen


def test_status_lists_replicas_health_and_load(cluster):
    report = cluster.status()
    assert report["applications"]["mlc"]["status"] == "RUNNING"
    assert [r["health"] for r in report["replicas"]] == ["healthy", "healthy"]
    assert {r["node"] for r in report["replicas"]} == {"127.0.0.1"}  # a local head never leaves loopback
    assert report["deployed"]["replicas"] == 2 and report["deployed"]["generation"] == 1


def load(cluster, stop: threading.Event, results: list) -> None:
    """Requests back to back, every other one streamed; each result is "ok", "clean" (a JSON error, or a stream
    that ends with an error event and [DONE]) or "broken"."""
    i = 0
    while not stop.is_set():
        i += 1
        body = {"prompt": f"Load {i}: how long does shipping take to city {i}?", "max_tokens": 8}
        try:
            if i % 2:
                with httpx.stream("POST", cluster.url + "/v1/completions", headers=AUTH, timeout=60,
                                  json={**body, "stream": True}) as s:
                    lines = [x for x in s.iter_lines() if x.startswith("data: ")]
                done = s.status_code == 200 and lines[-1:] == ["data: [DONE]"]
                failed = done and len(lines) > 1 and '"error"' in lines[-2]
                results.append("clean" if failed else "ok" if done else "broken")
            else:
                r = cluster.post("/v1/completions", body)
                results.append("ok" if r.status_code == 200 else "clean" if "error" in r.json() else "broken")
        except (httpx.HTTPError, ValueError):  # a dropped connection or a body that is not JSON
            results.append("broken")


def run_load(cluster, during, workers: int = 3) -> list:
    stop, results = threading.Event(), []
    threads = [threading.Thread(target=load, args=(cluster, stop, results)) for _ in range(workers)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        during()
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    return results


def test_a_killed_replica_fails_at_most_its_requests_cleanly_and_comes_back(cluster):
    before = cluster.status()["replicas"]
    victim = before[0]
    results = run_load(cluster, lambda: os.kill(victim["pid"], signal.SIGKILL))
    assert len(results) >= 10 and "broken" not in results, results
    assert results.count("clean") <= 3, results  # at most the requests in flight on that replica
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = [r for r in cluster.status()["replicas"] if r["health"] == "healthy"]
        if len(now) == 2 and victim["pid"] not in {r["pid"] for r in now}:
            break
        time.sleep(2)
    else:
        raise AssertionError(f"the killed replica did not come back: {now}")


def test_rolling_onto_an_adapter_fails_no_request(cluster):
    lora = adapter(cluster.model, cluster.root / "a1", seed=1)
    def roll():
        ok(cli("deploy", "--cluster-config", str(cluster.config), "--lora", f"a1={lora}"))

    results = run_load(cluster, roll, workers=2)
    assert len(results) >= 10 and set(results) == {"ok"}, results
    r = cluster.post("/v1/completions", {"model": "a1", "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["model"] == "a1"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the last old replica may still be draining when deploy returns
        report = cluster.status()
        if [(r["generation"], r["health"]) for r in report["replicas"]] == [(2, "healthy")] * 2:
            break
        time.sleep(2)
    assert report["deployed"]["adapters"] == ["a1"] and report["deployed"]["generation"] == 2
    assert [(r["generation"], r["health"], r["adapters"]) for r in report["replicas"]] == [(2, "healthy", ["a1"])] * 2


def test_training_on_the_pool_survives_a_killed_worker_and_its_adapter_rolls_on(cluster):
    from mlc.config.loader import validate_train_config
    from mlc.train.logging import TrainLog
    from mlc.train.run import RunOptions, train

    root = cluster.root
    tiny = build_tiny_llama(root / "tiny")
    (root / "train.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ROWS))
    raw = {"model": str(tiny), "data": {"train": str(root / "train.jsonl"), "eval": None},
           "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]},
           "optimizer": {"lr": 1e-2}, "batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 12,
           "max_seq_len": 64, "save_every": 3, "seed": 3, "precision": "fp32", "output_dir": "cs"}
    (root / "lora.yaml").write_text(yaml.safe_dump(raw))
    proc = subprocess.Popen([sys.executable, "-m", "mlc.cli.main", "train", "--config", str(root / "lora.yaml"),
                             "--cluster-config", str(cluster.config)],
                            env={**ENV, "MLC_TEST_TRAIN_STEP_DELAY_S": "0.4"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out_dir = root / "runs" / "cs"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        steps = [r["step"] for r in TrainLog(out_dir).step_records()] if (out_dir / "train_log.jsonl").exists() else []
        if steps and steps[-1] >= 4:
            break
        time.sleep(0.05)
    workers = [int(p) for p in subprocess.run(["pgrep", "-f", "RayTrainWorker"], capture_output=True,
                                              text=True).stdout.split()]
    assert proc.poll() is None and workers, "the run ended before a worker could be killed"
    os.kill(workers[-1], signal.SIGKILL)
    output, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, output
    assert "resumed after 1 worker failure" in output
    reference = train(validate_train_config({**raw, "gradient_accumulation_steps": 2, "output_dir": str(root / "ref")}),
                      RunOptions(fresh=True, progress=False))
    got = {r["step"]: r["loss"] for r in TrainLog(out_dir).step_records()}
    ref = {r["step"]: r["loss"] for r in TrainLog(reference.output_dir).step_records()}
    assert sorted(got) == sorted(ref) == list(range(1, 13))
    assert max(abs(got[s] - ref[s]) for s in ref) < 1e-5  # the same curve as one process, despite the kill
    roll = next(line for line in output.splitlines() if line.startswith("roll it onto the replicas: "))
    command = roll.removeprefix("roll it onto the replicas: mlc-cli ").split()
    assert command[command.index("--model") + 1] == str(tiny)  # the adapter's base, not the cluster file's model
    ok(cli(*command))
    r = cluster.post("/v1/chat/completions", {"model": "cs", "messages": [{"role": "user", "content": "Refund?"}],
                                              "max_tokens": 4})
    assert r.status_code == 200 and r.json()["model"] == "cs"
    models = httpx.get(cluster.url + "/v1/models", headers=AUTH, timeout=30).json()
    assert [m["id"] for m in models["data"]] == [str(tiny), "cs"]
