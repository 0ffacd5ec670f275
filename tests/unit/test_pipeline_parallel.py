"""Pipeline parallelism without processes: the layer split into stages, the features it refuses, and the
scheduler's side of the batch queue (sequences in flight skipped and never preempted, micro-batches capped)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

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
    (dict(tensor_parallel_size=2), "tensor parallelism inside a stage"),
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


def test_a_replica_with_stages_holds_a_device_per_stage_on_one_node():
    from mlc.cluster.resources import needed, replica_actor_options
    from mlc.cluster.service import check_stages, replica_serve_config
    from mlc.config.cluster_config import ClusterConfig
    from mlc.config.serve_config import ServeConfig

    cfg = ClusterConfig(model="m", hardware="nvidia-h200", nodes=["a", "b"], pipeline_parallel_size=4,
                        data_parallel_size=4)
    check_stages(cfg)
    assert replica_actor_options(cfg, "cuda")["num_gpus"] == 4
    assert needed(cfg, "cuda", "inference")["GPU"] == 16
    engine = replica_serve_config(cfg, ServeConfig(), "cuda").engine
    assert engine.pipeline_parallel_size == 4 and engine.tensor_parallel_size == 1


@pytest.mark.parametrize("change, message", [
    (dict(pipeline_parallel_size=16, data_parallel_size=1), "spans nodes .* not built yet; use "
                                                            "pipeline_parallel_size 8 or less"),
    (dict(pipeline_parallel_size=2, tensor_parallel_size=4, data_parallel_size=1),
     "tensor parallelism inside a pipeline stage is not built yet"),
])
def test_replicas_with_stages_that_cannot_run_yet_are_refused_before_anything_starts(change, message):
    from mlc.cluster.service import check_stages
    from mlc.config.cluster_config import ClusterConfig
    from mlc.errors import ClusterError

    with pytest.raises(ClusterError, match=message):
        check_stages(ClusterConfig(model="m", hardware="nvidia-h200", nodes=["a", "b"], **change))
