"""The cluster schema (pools), the Ray resources it turns into, prefix-affinity decisions, the merged metrics page,
the ASGI bridge a replica serves through, the launcher's presets, and the errors met before anything starts."""

from __future__ import annotations

import asyncio
import builtins
import json
import random
from collections import Counter

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from mlc.cluster.affinity import AffinityTable, choose, chunk_hashes, prompt_text, rendezvous
from mlc.cluster.asgi_bridge import ForwardedRequest, ResponseStart, run_asgi
from mlc.cluster.metrics_merge import merge
from mlc.cluster.resources import needed, raylets, replica_actor_options, shortfall, worker_resources
from mlc.config.cluster_config import ClusterConfig
from mlc.errors import ClusterError, ConfigError

SPLIT = {"model": "m", "hardware": "nvidia-h200", "nodes": ["a", "b"], "tensor_parallel_size": 4,
         "data_parallel_size": 3,
         "pools": {"inference": ["a", {"host": "b", "devices": [0, 1, 2, 3]}],
                   "training": [{"host": "b", "devices": [4, 5, 6, 7]}]}}


# schema
def test_pools_split_nodes_and_devices():
    cfg = ClusterConfig(**SPLIT)
    assert cfg.pool_devices("inference") == {"a": list(range(8)), "b": [0, 1, 2, 3]}
    assert cfg.pool_devices("training") == {"b": [4, 5, 6, 7]}
    assert cfg.pool_size("inference") == 12 and cfg.replicas == 3 and cfg.image is None
    plain = ClusterConfig(model="m", nodes=["a"])  # no pools: every device serves, none trains
    assert plain.pool_size("inference") == 8 and plain.pool_size("training") == 0


@pytest.mark.parametrize("change, message", [
    ({"pools": {"inference": ["a"], "training": ["a"]}}, "in both pools"),
    ({"pools": {"inference": ["c"]}}, "is not one of the nodes"),
    ({"pools": {"inference": [{"host": "a", "devices": [9]}]}}, "has no device"),
    ({"pools": {"inference": ["a", {"host": "a", "devices": [0]}]}}, "listed twice"),
    ({"data_parallel_size": 4}, "inference pool has 12"),
    ({"training": {"workers": 5}}, "exceeds the training pool"),
    ({"ray_address": "http://x"}, "ray://HOST:PORT"),
    ({"pools": {"inference": [{"host": "b", "devices": [0, 1]}], "training": ["a"]}, "data_parallel_size": 1,
      "tensor_parallel_size": 4}, "inference pool has 2"),
])
def test_bad_pools_are_refused_with_what_to_do(change, message):
    with pytest.raises(ValueError, match=message):
        ClusterConfig(**{**SPLIT, **change})


# resources
def test_each_pool_is_a_ray_resource_and_a_split_node_runs_a_raylet_per_pool():
    cfg = ClusterConfig(**SPLIT)
    lines = [r.command("cuda", "a:6379") for r in raylets(cfg, "cuda")]
    assert lines[0].startswith("CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=")
    assert "--head --port=6379 --num-gpus=8" in lines[0] and '"mlc_inference": 8' in lines[0]
    assert lines[1].startswith("CUDA_VISIBLE_DEVICES=0,1,2,3 ray start --address=a:6379 --num-gpus=4")
    assert lines[2].startswith("CUDA_VISIBLE_DEVICES=4,5,6,7 ray") and '"mlc_training": 4' in lines[2]
    assert replica_actor_options(cfg, "cuda") == {"num_cpus": 1.0, "num_gpus": 4, "resources": {"mlc_inference": 4}}
    assert replica_actor_options(cfg, "npu")["resources"] == {"mlc_inference": 4, "NPU": 4}
    assert worker_resources(cfg, "npu") == {"CPU": 1.0, "mlc_training": 1, "NPU": 1}
    assert needed(cfg, "cuda", "inference") == {"CPU": 3.0, "mlc_inference": 12, "GPU": 12}
    assert shortfall({"GPU": 12, "CPU": 1}, {"GPU": 8, "CPU": 4}) == ["GPU: needs 12, the cluster has 8"]


def test_a_cpu_node_carries_both_pools_on_one_raylet():
    cfg = ClusterConfig(model="m", hardware="cpu", nodes=["localhost"], devices_per_node=4,
                        pools={"inference": [{"host": "localhost", "devices": [0, 1]}],
                               "training": [{"host": "localhost", "devices": [2, 3]}]})
    (only,) = raylets(cfg, "cpu")
    assert only.head and only.pools == {"mlc_inference": 2, "mlc_training": 2}
    assert only.env("cpu") == {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH":
                               "mlc.cluster.proxy_headers:middlewares"}


# prefix affinity
def test_prompt_text_per_route():
    chat = {"model": "a1", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": "Hi"}]}]}
    assert prompt_text("/v1/chat/completions", json.dumps(chat).encode()) == "a1\0<system>Be brief.<user>Hi"
    assert prompt_text("/generate", b'{"prompt": "Hello"}') == "\0Hello"
    assert prompt_text("/v1/completions", b'{"prompt": [[5, 6], [7]]}') == "\0" + "5 6"
    assert prompt_text("/health", b"") is None and prompt_text("/generate", b"not json") is None


def test_chunk_hashes_are_chained_prefix_keys():
    a = chunk_hashes("x" * 64 + "tail-a" * 20, 32)
    b = chunk_hashes("x" * 64 + "tail-b" * 20, 32)
    assert a[:2] == b[:2] and a[2] != b[2]  # equal up to where the texts part
    assert chunk_hashes("short", 32) == () and len(chunk_hashes("y" * 100, 32)) == 3


def test_choose_follows_the_prefix_until_its_replica_is_overloaded():
    table = AffinityTable()
    chunks = chunk_hashes("shared system prompt " * 10, 32)
    loads = {"r1": 0, "r2": 0, "r3": 0}
    ranks, decision = choose(chunks, loads, table, max_load_gap=2)
    first = ranks[0][0]
    assert decision == "new_prefix" and first == rendezvous(chunks[0], ["r3", "r1", "r2"])
    table.record(chunks, "r2")  # it went to r2 after all
    ranks, decision = choose(chunks + ("deeper",), loads, table, 2)
    assert decision == "affinity" and ranks[0] == ["r2"] and sorted(ranks[1]) == ["r1", "r3"]
    ranks, decision = choose(chunks, {"r1": 0, "r2": 3, "r3": 1}, table, 2)
    assert decision == "overloaded" and ranks == [["r1", "r3"]]
    ranks, decision = choose((), loads, table, 2)
    assert decision == "no_prefix" and len(ranks) == 1 and len(set(ranks[0]) & set(loads)) == 2
    table.forget({"r2"})
    assert choose(chunks, loads, table, 2)[1] == "new_prefix"


def test_idle_replicas_share_requests_without_a_prefix():
    """Prompts shorter than one chunk have no prefix to follow: equally busy replicas take them at random (sorting
    by id sent every one to the same replica), and a busier replica is never ranked first."""
    table, rng = AffinityTable(), random.Random(0)
    firsts = Counter(choose(chunk_hashes(f"Hi {i}", 32), {"r1": 0, "r2": 0}, table, 2, rng)[0][0][0] for i in range(16))
    assert set(firsts) == {"r1", "r2"} and min(firsts.values()) >= 4, firsts
    busy = {"r1": 1, "r2": 0, "r3": 0}
    assert {choose((), busy, table, 2, rng)[0][0][0] for _ in range(16)} == {"r2", "r3"}


def test_metrics_of_all_replicas_in_one_page():
    page = ("# HELP mlc:x Things.\n# TYPE mlc:x counter\nmlc:x_total{model_name=\"m\"} 1.0\n"
            "# HELP mlc:y Gauge.\n# TYPE mlc:y gauge\nmlc:y 2.0\n")
    merged = merge({"r1": page, "r2": page.replace("1.0", "5.0")})
    assert merged.count("# HELP mlc:x") == 1 and merged.count("# TYPE mlc:y") == 1
    assert 'mlc:x_total{replica="r1",model_name="m"} 1.0' in merged
    assert 'mlc:x_total{replica="r2",model_name="m"} 5.0' in merged and 'mlc:y{replica="r2"} 2.0' in merged
    lines = merged.splitlines()
    assert lines.index('mlc:x_total{replica="r2",model_name="m"} 5.0') < lines.index("# HELP mlc:y Gauge.")


# the bridge a replica serves through
def bridge_app(seen: list) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        return {"body": (await request.json()), "client": request.client.host}

    @app.get("/stream")
    async def stream(request: Request):
        async def chunks():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
            finally:
                seen.append("closed")

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


def test_the_bridge_runs_the_app_and_streams_until_the_caller_leaves():
    seen: list = []
    app = bridge_app(seen)
    scope = {"method": "POST", "path": "/echo", "headers": [(b"content-type", b"application/json")],
             "client": ("10.1.2.3", 5), "query_string": b""}

    async def main():
        out = [x async for x in run_asgi(app, ForwardedRequest.from_scope(scope, b'{"a": 1}'), "r1")]
        assert isinstance(out[0], ResponseStart) and out[0].status == 200 and out[0].replica == "r1"
        assert json.loads(b"".join(out[1:])) == {"body": {"a": 1}, "client": "10.1.2.3"}
        stream = run_asgi(app, ForwardedRequest("GET", "/stream", b"", [], b""))
        got = [await stream.__anext__() for _ in range(4)]
        await stream.aclose()  # the client went away
        assert got[1] == b"data: 0\n\n" and seen == ["closed"]

    asyncio.run(main())


# launcher and errors before anything starts
def test_launcher_presets_and_commands():
    from mlc.cli.launcher import Mode, command_for, device_for
    from mlc.cluster.presets import Hardware, find_preset, recommend

    assert find_preset("GLM5").name == "glm-5" and find_preset("glm-4.5").name == "glm-4.5"
    with pytest.raises(ConfigError, match="presets: glm5, glm4.5, glm4-9b, smollm2"):
        find_preset("llama9")
    assert device_for("cuda", 3) == "cuda:3" and device_for("cpu", None) == "cpu"
    with pytest.raises(ConfigError, match="only the CPU"):
        device_for("cpu", 1)
    preset = find_preset("smollm2")
    settings = recommend(preset, Hardware("cpu", "cpu", 1, "cpu"), 1000)
    assert settings.fits and settings.devices == 1 and settings.seq_len == 1000
    serve = command_for(Mode.inference, preset, settings, "/m", "cpu")
    assert serve[:3] == ["serve", "--model", "/m"] and "--max-seq-len" in serve and "1000" in serve
    assert command_for(Mode.train, preset, settings, "/m", "cpu") == ["train", "model=/m", "max_seq_len=1008",
                                                                        "device=cpu"]


def test_missing_preset_weights_say_where_to_put_them(tmp_path, monkeypatch):
    from mlc.cluster.presets import find_preset, weights_dir
    from mlc.errors import ModelNotFoundError

    monkeypatch.setenv("MLC_HOME", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match=f"`mlc-cli models pull glm-5`, or put .* in {tmp_path}/models/glm-5/"):
        weights_dir(find_preset("glm5"))


def test_without_ray_the_command_says_how_to_install_it(monkeypatch):
    from mlc.cluster.ray_runtime import require_ray

    real = builtins.__import__

    def no_ray(name, *args, **kw):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"No module named {name!r}", name="ray")
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ClusterError, match=r"pip install 'mlc\[cluster\]'"):
        require_ray("mlc-cli deploy")


def test_an_unreachable_address_fails_before_anything_starts():
    import socket

    from mlc.cluster.ray_runtime import connect

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = ClusterConfig(model="m", hardware="cpu", nodes=["a"], ray_address=f"127.0.0.1:{port}")
    with pytest.raises(ClusterError, match="cannot reach the Ray cluster at 127.0.0.1"):
        connect(cfg, "cpu")


def test_deploy_without_a_cluster_config_says_what_to_pass(capsys):
    from mlc.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["deploy"])
    assert exit_.value.code == 2
    assert "pass --cluster-config cluster.yaml" in capsys.readouterr().err


def test_a_stream_whose_replica_dies_ends_with_an_error_event_and_done():
    from mlc.cluster.gateway import Gateway

    class DyingStream:
        cancelled = False

        def __aiter__(self):
            return self

        async def __anext__(self):
            if not hasattr(self, "sent"):
                self.sent = True
                return b'data: {"text": "a"}\n\n'
            raise RuntimeError("ActorDiedError: the replica died")

        def cancel(self):
            self.cancelled = True

    async def main():
        stream = DyingStream()
        start = ResponseStart(200, [(b"content-type", b"text/event-stream; charset=utf-8")], "r1")
        chunks = [c async for c in Gateway._body(None, stream, start)]
        return stream, chunks

    stream, chunks = asyncio.run(main())
    assert chunks[0] == b'data: {"text": "a"}\n\n' and chunks[-1] == b"data: [DONE]\n\n"
    error = json.loads(chunks[1].decode().removeprefix("data: "))["error"]
    assert error["type"] == "service_unavailable" and error["code"] == "replica_failed"
    assert stream.cancelled


def test_a_roll_replaces_one_replica_at_a_time_and_the_printed_roll_keeps_the_trained_model():
    from ray import serve

    from mlc.cluster.service import one_at_a_time
    from mlc.cluster.train import roll_command

    class Replica:
        pass

    config = serve.deployment(Replica, **one_at_a_time()).options(num_replicas=12)._deployment_config
    assert int(config.rolling_update_percentage * 12) == 0  # Serve rounds down to at least one: one at a time
    assert roll_command("c.yaml", "support", "/runs/a", "m1", "m1") == (
        "mlc-cli deploy --cluster-config c.yaml --lora support=/runs/a")
    assert roll_command("c.yaml", "support", "/runs/a", "m2", "m1") == (
        "mlc-cli deploy --cluster-config c.yaml --model m2 --lora support=/runs/a")
