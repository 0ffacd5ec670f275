"""Pipeline parallelism without processes: the layer split into stages, the features it refuses, and the
scheduler's side of the batch queue (sequences in flight skipped and never preempted, micro-batches capped)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from mlc.config.cluster_config import ClusterConfig
from mlc.config.engine_config import EngineConfig
from mlc.distributed.checks import check_pipeline_parallel
from mlc.engine.pp_stage import split_layers, stage_ranges
from mlc.errors import ConfigError
from tests.unit.test_scheduler import _three_full_pages, make_sched, make_seq, step


def test_layers_split_evenly_with_the_remainder_on_the_first_stages():
    assert split_layers(30, 2) == [(0, 15), (15, 30)]
    assert split_layers(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert split_layers(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert split_layers(3, 1) == [(0, 3)]


def test_more_stages_than_layers_is_refused_with_what_to_set():
    with pytest.raises(ConfigError, match="more than the model's 2 layers; use --pipeline-parallel-size 2"):
        split_layers(2, 3)
    with pytest.raises(ConfigError, match="use --pipeline-parallel-size 2 or less"):
        check_pipeline_parallel(SimpleNamespace(num_hidden_layers=2), 3, "cpu")


def test_stages_of_tensor_parallel_ranks_need_a_core_each_and_heads_that_split(monkeypatch):
    from mlc.distributed import checks
    from mlc.errors import DeviceError

    cfg = SimpleNamespace(num_hidden_layers=4, vocab_size=64, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=64, model_type="llama")
    monkeypatch.setattr(checks, "devices_available", lambda device: 3)
    with pytest.raises(DeviceError, match="pipeline parallel size 2 x tensor parallel size 2 is larger than the 3 CPU"):
        check_pipeline_parallel(cfg, 2, "cpu", tp=2)
    check_pipeline_parallel(cfg, 3, "cpu")
    check_pipeline_parallel(cfg, 2, "cpu", tp=2, local=False)  # placed elsewhere: this machine's cores do not count
    with pytest.raises(ConfigError, match="tensor parallel size 3 does not divide"):
        check_pipeline_parallel(cfg, 2, "cpu", tp=3, local=False)


def test_a_dsa_stage_begins_at_a_full_indexer_layer():
    """A "shared" layer reuses the selection of the full layer before it: both stay in one stage."""
    cfg = SimpleNamespace(model_type="glm_moe_dsa", num_hidden_layers=4, indexer_types=["full", "shared", "shared",
                                                                                        "full"])
    assert stage_ranges(cfg, 2) == [(0, 3), (3, 4)]
    cfg.num_hidden_layers, cfg.indexer_types = 3, ["full", "shared", "full"]
    assert stage_ranges(cfg, 2) == [(0, 2), (2, 3)]
    cfg.num_hidden_layers, cfg.indexer_types = 4, ["full", "shared", "shared", "shared"]
    with pytest.raises(ConfigError, match="1 stages at most"):
        stage_ranges(cfg, 2)


@pytest.mark.parametrize("extra, what", [
    (dict(lora_adapters={"a": "/x"}), "LoRA adapters"),
    (dict(speculative_config={"method": "ngram"}), "speculative decoding"),
    (dict(sparse_kv={"ratio": 0.5}), "sparse_kv"),
    (dict(compile=True), "--compile"),
])
def test_features_not_built_with_stages_are_refused_in_one_line(extra, what):
    with pytest.raises(ValidationError, match=f"pipeline parallelism with {re.escape(what)}.* is not built yet"):
        EngineConfig(pipeline_parallel_size=2, **extra)
    EngineConfig(pipeline_parallel_size=1, **extra)  # alone each is fine


def test_stages_need_the_model_by_name_not_a_model_object():
    from mlc.engine.llm_engine import LLMEngine

    with pytest.raises(ConfigError, match="pass the model's name or path"):
        LLMEngine(EngineConfig(pipeline_parallel_size=2), model=object())  # type: ignore[arg-type]


def test_a_sequence_in_flight_is_skipped_until_its_step_returns():
    sched = make_sched(max_batch_size=8)
    seqs = [make_seq(3) for _ in range(4)]
    for s in seqs:
        sched.add(s)
    first = sched.schedule(max_seqs=2)  # one micro-batch: half the sequences
    assert [s.seq for s in first.scheduled] == seqs[:2]
    flying = frozenset(s.seq_id for s in seqs[:2])
    second = sched.schedule(flying, max_seqs=2)
    assert [s.seq for s in second.scheduled] == seqs[2:]
    assert sched.schedule(flying | {s.seq_id for s in seqs[2:]}).scheduled == []  # nothing runs twice at once
    sched.advance(first.scheduled, {}, 1.0)
    sched.postprocess(seqs[:2], [(5, None)] * 2, 1.0)
    again = sched.schedule(frozenset(s.seq_id for s in seqs[2:]))
    assert [s.seq for s in again.scheduled] == seqs[:2]


def test_a_sequence_in_flight_is_never_preempted():
    sched, (a, b, c) = _three_full_pages()
    out = sched.schedule(frozenset({c.seq_id}))  # c, the newest, would be the victim; it is in flight
    assert out.preempted == [b]
    assert [s.seq for s in out.scheduled] == [a]
    assert c in sched.running and c.page_table


def test_without_a_cap_a_step_takes_every_sequence():
    sched = make_sched(max_batch_size=8)
    for _ in range(3):
        sched.add(make_seq(3))
    out, _ = step(sched)
    assert len(out.scheduled) == 3


def test_metrics_show_each_stages_busy_time_and_steps():
    from prometheus_client import CollectorRegistry, generate_latest

    from mlc.engine.outputs import EngineStats
    from mlc.server.observability.metrics import EngineCollector

    stats = EngineStats(0, 0, 0.0, 10, 10, 0, 0, 0, 0, 0, stage_busy=[(1.5, 7), (2.25, 7)])
    registry = CollectorRegistry()
    registry.register(EngineCollector("m", lambda: stats, lambda: 0, 16))
    text = generate_latest(registry).decode()
    assert 'mlc:pipeline_stage_busy_seconds_total{model_name="m",stage="1"} 2.25' in text
    assert 'mlc:pipeline_stage_steps_total{model_name="m",stage="0"} 7.0' in text
    registry = CollectorRegistry()
    registry.register(EngineCollector("m", lambda: EngineStats(0, 0, 0.0, 10, 10, 0, 0, 0, 0, 0), lambda: 0, 16))
    assert "pipeline_stage" not in generate_latest(registry).decode()  # one process: no such series


def test_a_replica_with_stages_gets_a_placement_group_bundle_per_stage():
    from mlc.cluster.resources import bundle_actor_options, needed, replica_bundles
    from mlc.cluster.service import replica_serve_config, stage_note
    from mlc.config.cluster_config import ClusterConfig
    from mlc.config.serve_config import ServeConfig

    cfg = ClusterConfig(model="m", hardware="nvidia-h200", nodes=["a", "b"], pipeline_parallel_size=4,
                        data_parallel_size=4, serving={"cpus_per_replica": 8})
    assert "on one node" in stage_note(cfg)
    bundles = replica_bundles(cfg, "cuda")
    assert bundles == [{"CPU": 2.0, "mlc_inference": 1.0, "GPU": 1.0}] * 4
    assert bundle_actor_options(bundles[0]) == {"num_cpus": 2.0, "num_gpus": 1.0, "resources": {"mlc_inference": 1.0}}
    assert needed(cfg, "cuda", "inference")["GPU"] == 16  # the bundles of 4 replicas
    engine = replica_serve_config(cfg, ServeConfig(), "cuda").engine
    assert engine.pipeline_parallel_size == 4 and engine.tensor_parallel_size == 1 and engine.num_threads is None
    one = ClusterConfig(model="m", hardware="nvidia-h200", nodes=["a"], data_parallel_size=8)
    assert replica_bundles(one, "cuda") is None  # one process a replica: one actor, no placement group


def test_stages_may_span_nodes():
    from mlc.cluster.resources import replica_bundles
    from mlc.cluster.service import stage_note
    from mlc.config.cluster_config import ClusterConfig

    cfg = ClusterConfig(model="m", hardware="cpu", nodes=["a", "b"], devices_per_node=1, pipeline_parallel_size=2)
    assert "on 2 nodes or more (at most 1 stages a node)" in stage_note(cfg)
    assert replica_bundles(cfg, "cpu") == [{"CPU": 0.5, "mlc_inference": 1.0}] * 2
    with pytest.raises(ValueError, match="pipeline parallel = 3 devices, but the nodes have 2"):
        ClusterConfig(model="m", hardware="cpu", nodes=["a", "b"], devices_per_node=1, pipeline_parallel_size=3)
    two_by_two = ClusterConfig(model="m", hardware="cpu", nodes=["a", "b"], devices_per_node=2,
                               pipeline_parallel_size=2, tensor_parallel_size=2, serving={"cpus_per_replica": 2})
    assert "2 pipeline stages, 2 devices of one node each, in a Ray placement group: on 2 nodes or more" in (
        stage_note(two_by_two))
    assert replica_bundles(two_by_two, "cpu") == [{"CPU": 1.0, "mlc_inference": 2.0}] * 2
    with pytest.raises(ValueError, match="tensor_parallel_size 4 spans nodes"):  # a stage's ranks share a node
        ClusterConfig(model="m", hardware="cpu", nodes=["a", "b"], devices_per_node=2, pipeline_parallel_size=1,
                      tensor_parallel_size=4)



def test_nodes_that_cannot_hold_every_stage_bundle_are_refused_before_anything_starts():
    """Three devices a node hold one stage of two TP ranks each: three stages need three nodes, not two."""
    from mlc.cluster.service import stage_note
    from mlc.errors import ClusterError

    cfg = ClusterConfig(model="m", hardware="cpu", nodes=["a", "b"], devices_per_node=3, pipeline_parallel_size=3,
                        tensor_parallel_size=2)
    with pytest.raises(ClusterError, match="need 3 groups of 2 inference devices on one node, and the nodes hold 2"):
        stage_note(cfg)


def test_a_prefill_decode_layout_with_parallel_instances_is_refused_before_anything_starts():
    from mlc.cluster.service import _preflight
    from mlc.errors import ClusterError

    pools = {"prefill": [{"host": "a", "devices": [0, 1]}], "decode": [{"host": "a", "devices": [2, 3]}]}
    cfg = ClusterConfig(model="m", hardware="cpu", nodes=[{"host": "a", "devices": [0, 1, 2, 3]}],
                        devices_per_node=4, tensor_parallel_size=2, pools=pools)
    with pytest.raises(ClusterError, match="instances run one process each: set tensor_parallel_size"):
        _preflight(cfg, "cpu")


@pytest.mark.parametrize("token, ok", [("the-token", True), ("not-it", False)])
def test_the_control_port_unpickles_nothing_before_the_token_is_shown(token, ok, monkeypatch):
    import socket
    import threading

    from mlc.engine import tp_worker
    from mlc.engine.tp_group import _greet

    server = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setenv("MLC_TP_TOKEN", token)
    worker = threading.Thread(target=lambda: tp_worker._connect("127.0.0.1", server.getsockname()[1], 3))
    worker.start()
    greeted = _greet(server.accept()[0], b"the-token")
    worker.join()
    server.close()
    assert (greeted is not None and greeted[0] == 3) == ok
