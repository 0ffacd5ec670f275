"""Cluster figures (README, scale-out): time to a healthy deployment, prefix-affinity gain (bench serve on a shared-prefix workload,
prefix_affinity vs power_of_two), replica kill under load. Default model, 2 CPU replicas, local head."""
import json, os, signal, subprocess, sys, threading, time
import httpx, yaml

PY = sys.executable  # run it with the venv that has mlc[cluster]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
PORT = 8395
URL = f"http://127.0.0.1:{PORT}"

def cli(*a, timeout=900):
    r = subprocess.run([PY, "-m", "mlc.cli.main", *a], env=ENV, text=True, capture_output=True, timeout=timeout)
    if r.returncode:
        print(r.stdout, r.stderr); raise SystemExit(1)
    return r.stdout

def write(routing):
    yaml.safe_dump({"engine": {"kv_cache_memory": "120MiB", "max_batch_size": 8, "max_seq_len": 1024}},
                   open("serve.yaml", "w"))
    yaml.safe_dump({"model": "smollm2-135m-instruct", "hardware": "cpu", "ray_address": "local:6395",
                    "nodes": ["localhost"], "devices_per_node": 2, "data_parallel_size": 2, "port": PORT,
                    "serve_config": "serve.yaml", "serving": {"cpus_per_replica": 1, "routing": routing}},
                   open("cluster.yaml", "w"))

def dataset():
    topics = ["shipping", "refunds", "warranty", "billing", "accounts", "returns", "coupons", "gift cards",
              "delivery slots", "damaged items", "price matching", "loyalty points", "subscriptions",
              "international orders", "store pickup", "exchanges"]
    rows = []
    for t in topics:
        system = (f"You are the {t} assistant of an online shop. " +
                  " ".join(f"Rule {i} about {t}: answer politely, cite the {t} policy section {i}, never invent "
                           f"facts, and keep answers short." for i in range(12)))
        for q in range(6):
            rows.append({"messages": [{"role": "system", "content": system},
                                      {"role": "user", "content": f"Question {q} about {t}: what should I do?"}]})
    with open("shared.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return len(rows)

def metric_sum(name):
    text = httpx.get(URL + "/metrics", timeout=30).text
    return sum(float(l.rpartition(" ")[2]) for l in text.splitlines() if l.startswith(name + "{"))

def bench(n, tag):
    cli("bench", "serve", "--url", URL, "--dataset", "shared.jsonl", "--concurrency", "4", "--num-prompts", str(n),
        "--max-tokens", "8", "--warmup", "0", "--json", f"bench-{tag}.json")
    time.sleep(2.5)
    hits, queries = metric_sum("mlc:prefix_cache_hits_total"), metric_sum("mlc:prefix_cache_queries_total")
    res = json.load(open(f"bench-{tag}.json"))
    return {"hits": hits, "queries": queries, "hit_rate": hits / max(queries, 1), "bench": res}

def kill_under_load():
    status = json.loads(cli("deploy", "status", "--cluster-config", "cluster.yaml", "--json"))
    victim = status["replicas"][0]
    stop, results = threading.Event(), []
    def loop(k):
        i = 0
        while not stop.is_set():
            i += 1
            body = {"prompt": f"Worker {k} request {i}: how long does shipping take?", "max_tokens": 16}
            try:
                if i % 2:
                    with httpx.stream("POST", URL + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
                        lines = [x for x in s.iter_lines() if x.startswith("data: ")]
                    err = len(lines) > 1 and '"error"' in lines[-2]
                    results.append("clean" if err else "ok" if lines[-1:] == ["data: [DONE]"] else "broken")
                else:
                    r = httpx.post(URL + "/v1/completions", json=body, timeout=60)
                    results.append("ok" if r.status_code == 200 else "clean" if "error" in r.json() else "broken")
            except Exception:
                results.append("broken")
    threads = [threading.Thread(target=loop, args=(k,)) for k in range(4)]
    [t.start() for t in threads]
    time.sleep(3)
    t_kill = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    back = None
    while back is None and time.monotonic() - t_kill < 180:
        rs = json.loads(cli("deploy", "status", "--cluster-config", "cluster.yaml", "--json"))["replicas"]
        healthy = [r for r in rs if r["health"] == "healthy" and r["pid"] != victim["pid"]]
        if len(healthy) == 2:
            back = time.monotonic() - t_kill
        else:
            time.sleep(1)
    time.sleep(3)
    stop.set(); [t.join() for t in threads]
    return {"requests": len(results), "ok": results.count("ok"), "clean_failures": results.count("clean"),
            "broken": results.count("broken"), "replica_back_after_s": back}

out = {}
n = dataset()
for routing in ("prefix_affinity", "power_of_two"):
    write(routing)
    t0 = time.monotonic()
    print(cli("deploy", "--cluster-config", "cluster.yaml"), flush=True)
    out[routing] = {"deploy_s": time.monotonic() - t0, **bench(n, routing)}
    if routing == "prefix_affinity":
        out["kill"] = kill_under_load()
    print(cli("deploy", "down", "--cluster-config", "cluster.yaml"), flush=True)
    print(json.dumps({k: ({kk: vv for kk, vv in v.items() if kk != "bench"} if isinstance(v, dict) else v)
                      for k, v in out.items()}, indent=1), flush=True)
json.dump(out, open("measure.json", "w"), indent=1)
