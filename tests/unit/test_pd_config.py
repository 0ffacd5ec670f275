"""The prefill/decode layout of a cluster file: both pools with devices and one KV format, or `config check` refuses
it before anything starts; the router's prompt estimate and its pool counters."""

from __future__ import annotations

import pytest

from mlc.cluster.pd_router import PDRouter, generation_body, long_enough, prompt_chars
from mlc.config.cluster_config import ClusterConfig
from tests.unit.test_config import run_cli

PD = {"model": "m", "hardware": "cpu", "nodes": [{"host": "a", "devices": [0, 1, 2, 3]}], "devices_per_node": 4,
      "pools": {"prefill": [{"host": "a", "devices": [0, 1]}], "decode": [{"host": "a", "devices": [2, 3]}]},
      "pd": {"threshold_tokens": 512, "prefill": {"kv_cache_dtype": "int8"}, "decode": {"kv_cache_dtype": "int8"}}}


def test_a_pd_layout_is_accepted():
    cfg = ClusterConfig(**PD)
    assert cfg.pool_size("prefill") == 2 and cfg.pool_size("decode") == 2 and cfg.pd.threshold_tokens == 512


@pytest.mark.parametrize("change, message", [
    ({"pd": {"prefill": {"kv_cache_dtype": "int8"}, "decode": {"kv_cache_dtype": "fp16"}}},
     "decode instances cannot read the prefill instances' KV pages"),
    ({"pd": {"decode": {"page_size": 32}}}, "give both pools the same page_size"),
    ({"pools": {"prefill": [{"host": "a", "devices": []}], "decode": [{"host": "a", "devices": [2, 3]}]}},
     "pools.prefill has 0 device(s)"),
    ({"pools": {"prefill": [{"host": "a", "devices": [0, 1]}]}}, "needs both pools.prefill and pools.decode"),
    ({"tensor_parallel_size": 4}, "fewer than one instance needs (4"),
])
def test_a_pd_layout_that_cannot_work_is_refused(change, message):
    with pytest.raises(ValueError, match="pd|pools") as e:
        ClusterConfig(**{**PD, **change})
    assert message in str(e.value)


def test_config_check_refuses_mismatched_kv_formats(tmp_path, capsys):
    path = tmp_path / "cluster.yaml"
    path.write_text("model: m\nhardware: cpu\nnodes: [{host: a, devices: [0, 1]}]\ndevices_per_node: 2\n"
                    "pools: {prefill: [{host: a, devices: [0]}], decode: [{host: a, devices: [1]}]}\n"
                    "pd: {prefill: {kv_cache_dtype: int8}}\n")
    code, text = run_cli(["config", "check", str(path)], capsys)
    assert code != 0 and "kv_cache_dtype" in text and "same" in text


def test_router_estimates_prompts_and_counts_pools():
    assert prompt_chars({"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 9}) > 400
    assert prompt_chars({"max_tokens": 9}) == 0
    body = generation_body("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}')
    assert body is not None and not long_enough(body, 256) and long_enough(body, 5)
    assert generation_body("GET", "/v1/chat/completions", b"{}") is None
    assert generation_body("POST", "/v1/models", b"{}") is None
    assert generation_body("POST", "/v1/completions", b"[1, 2]") is None
    assert generation_body("POST", "/v1/completions", b"not json") is None
    router = PDRouter(["http://p"], ["http://d1", "http://d2"])
    router.in_flight["http://d1"] = 3
    assert router._pick(router.decode) == "http://d2"
    assert 'mlc_pd_pool_in_flight{pool="decode"} 3' in router.metrics_text()
    with pytest.raises(ValueError, match="decode instance"):
        PDRouter(["http://p"], [])


def test_router_ends_a_stream_with_an_error_event_when_the_decoder_dies():
    import asyncio

    import httpx

    class Dying(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"choices": [{"delta": {"content": "Hel"}}]}\n\n'
            raise httpx.ReadError("connection reset")

    def upstream(request: httpx.Request) -> httpx.Response:
        assert "x-mlc-kv-handle" not in request.headers  # a short prompt stays on D
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Dying())

    router = PDRouter(["http://p"], ["http://d"])
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(upstream))

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://pd") as client:
            return await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                   "stream": True})

    r = asyncio.run(go())
    assert '"Hel"' in r.text and "failed mid-stream" in r.text and r.text.rstrip().endswith("[DONE]")
    assert router.in_flight["http://d"] == 0 and router.routed["local"] == 1


def test_a_prefill_or_decode_role_with_tensor_parallelism_is_refused():
    from mlc.config.serve_config import ServeConfig

    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        ServeConfig(kv_role="decode", engine={"tensor_parallel_size": 2})
    assert ServeConfig(kv_role="both", engine={"tensor_parallel_size": 2}).kv_role == "both"


def test_deploy_runs_a_prefill_and_a_decode_application_with_their_roles_and_resources():
    from mlc.cluster.pd_deploy import gateway_pd, kv_token, pool_spec, replica_apps
    from mlc.cluster.resources import needed, pool_replicas, raylets, replica_actor_options
    from mlc.config.serve_config import ServeConfig

    cfg = ClusterConfig(**{**PD, "pd": {**PD["pd"], "kv_lease_timeout": 12.0, "decode": {"kv_cache_dtype": "int8",
                                                                                          "max_batch_size": 64}}})
    assert [(a.pool, a.app) for a in replica_apps(cfg)] == [("prefill", "mlc-prefill"), ("decode", "mlc-decode")]
    assert pool_replicas(cfg, "prefill") == pool_replicas(cfg, "decode") == 2  # one device an instance
    assert replica_actor_options(cfg, "cpu", "prefill")["resources"] == {"mlc_prefill": 1}
    assert needed(cfg, "cpu", "decode") == {"CPU": 2.0, "mlc_decode": 2}
    assert raylets(cfg, "cpu")[0].pools == {"mlc_prefill": 2, "mlc_decode": 2}  # `ray start --resources`
    spec = {"serve": ServeConfig().model_dump(mode="json")}
    decode = ServeConfig(**pool_spec(spec, cfg, "decode")["serve"])
    assert decode.kv_role == "decode" and decode.engine.kv_cache_dtype == "int8"
    assert decode.engine.max_batch_size == 64 and decode.engine.kv_lease_timeout == 12.0
    assert ServeConfig(**pool_spec(spec, cfg, "prefill")["serve"]).engine.max_batch_size is None
    assert gateway_pd(cfg) == {"threshold_tokens": 512}
    token = kv_token(cfg, None)
    assert token and kv_token(cfg, {"kv_token": token}) == token  # kept across a roll
    plain = ClusterConfig(model="m", hardware="cpu", nodes=["a"], devices_per_node=2, data_parallel_size=2)
    assert [a.app for a in replica_apps(plain)] == ["mlc-replicas"] and pool_spec(spec, plain, "inference") is spec
    assert kv_token(plain, None) is None and gateway_pd(plain) is None
