"""`plan` on the real shapes of GLM-4-9B, GLM-4.5-Air, GLM-4.5, GLM-5 and SmolLM2; its KV figures against what the
engine really allocates."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mlc.config.hardware import detect_cpu, load_profile
from mlc.engine.kv_cache import KVCache
from mlc.engine.memory import plan_cache
from mlc.errors import ConfigError, ModelFormatError, ModelNotFoundError
from mlc.plan.model_facts import inspect_model
from mlc.plan.planner import PlanRequest, evaluate, kv_bytes_per_token, plan, weight_bytes
from mlc.plan.shapes import PUBLISHED, SHAPES

DEFAULT = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def facts():
    return {name: inspect_model(name) for name in SHAPES}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_published_sizes(facts, name):
    total, active = PUBLISHED[name]
    f = facts[name]
    assert abs(f.total_params / total - 1) < 0.02, f"{name}: {f.total_params / 1e9:.3f}B vs {total / 1e9}B"
    # model cards round active counts and leave the embedding out; 12% covers both
    assert abs(f.active_params / active - 1) < 0.12, f"{name}: {f.active_params / 1e9:.3f}B active vs {active / 1e9}B"


def test_exact_counts_and_cache_layouts(facts):
    assert facts[DEFAULT].total_params == 134_515_008  # SmolLM2-135M, tied embeddings counted once
    assert facts["glm-4-9b"].total_params == 9_399_951_360
    glm5 = facts["glm-5"]
    assert glm5.kv_spec[0] == {"latent": (512 + 64,), "index_k": (128,)}  # MLA latent + DSA indexer key
    # bf16: 78 layers x 576 latent values + 78 full-indexer layers x 128, 2 bytes each
    assert kv_bytes_per_token(glm5.kv_spec, "bf16") == (78 * 576 * 2 + 78 * 128 * 2, True)
    air = facts["glm-4.5-air"]
    assert kv_bytes_per_token(air.kv_spec, "bf16") == (46 * 2 * 8 * 128 * 2, True)
    assert air.n_experts == 128 and air.top_k == 8


def test_weight_bytes_per_dtype(facts):
    f = facts["glm-4-9b"]
    assert weight_bytes(f, "bf16", "bf16") == f.total_params * 2
    assert weight_bytes(f, "fp32", "fp32") == f.total_params * 4
    int8, int4 = weight_bytes(f, "int8", "bf16"), weight_bytes(f, "int4", "bf16")
    unquantized = (f.total_params - f.quantizable_params) * 2
    assert int8 == math.ceil(f.quantizable_params * (1 + 2 / 128)) + unquantized
    assert int4 == math.ceil(f.quantizable_params * (0.5 + 2 / 128)) + unquantized
    assert int4 < int8 < f.total_params * 2


def test_default_model_figures_equal_the_engines_allocation(facts):
    """Plan's KV bytes/token and pages for the default model against a real KVCache of that many pages."""
    from mlc.models.loader import build_model
    from mlc.plan.shapes import hf_config_for

    cfg = hf_config_for(SHAPES[DEFAULT])
    model = build_model(cfg, torch.device("cpu"), torch.float32)  # real (uninitialised) CPU tensors this time
    spec = model.kv_cache_spec()
    assert spec == facts[DEFAULT].kv_spec
    request = PlanRequest(seq_len=1024, batch=2, kv_dtype="fp32", page_size=16)
    lay = plan(facts[DEFAULT], detect_cpu(), request).requested
    engine_plan = plan_cache(KVCache.bytes_per_token_for(spec, torch.float32), 16, None, 0.9, torch.device("cpu"),
                             2, 1024)
    assert lay.pages == engine_plan.num_pages == 2 * 64 + 1
    assert lay.kv_bytes_per_token == engine_plan.bytes_per_token == 30 * 2 * 3 * 64 * 4
    cache = KVCache(spec, lay.pages, 16, torch.float32, "cpu")
    allocated = sum(t.data.nbytes for layer in cache.layers for t in layer.values())
    assert lay.kv_bytes == cache.total_bytes() == allocated


def test_plan_matches_a_running_engine(tmp_path):
    """End to end: an LLMEngine on a tiny checkpoint allocates exactly the pages and bytes plan predicts."""
    from mlc.config.engine_config import EngineConfig
    from mlc.engine.llm_engine import LLMEngine
    from tests.support.tiny_llama import build_tiny_llama

    path = build_tiny_llama(tmp_path / "tiny")
    engine = LLMEngine(EngineConfig(model=str(path), max_batch_size=3, max_seq_len=200, kv_cache_fraction=0.9))
    lay = plan(inspect_model(str(path)), detect_cpu(), PlanRequest(seq_len=200, batch=3)).requested
    assert lay.kv_dtype == "fp32" and lay.pages == engine.cache_plan.num_pages == 3 * 13 + 1
    assert lay.kv_bytes_per_token == engine.kv_cache.bytes_per_token()
    assert lay.kv_bytes == engine.kv_cache.total_bytes()
    assert inspect_model(str(path / "config.json")).total_params == sum(p.numel() for p in engine.model.parameters())


def test_fits_and_largest_batch_are_consistent(facts):
    h = load_profile("ascend-910b")
    r = PlanRequest(seq_len=32768, batch=8)
    lay = plan(facts["glm-4-9b"], h, r).requested
    assert lay.fits and lay.kv_dtype == "fp16" and lay.weight_dtype == "fp16"  # 910B's preferred dtype
    assert lay.kv_bytes == lay.pages * 16 * lay.kv_bytes_per_token and lay.pages == 8 * 2048 + 1
    at_max = evaluate(facts["glm-4-9b"], h, PlanRequest(seq_len=32768, batch=lay.max_batch), "auto", "auto", None, 1)
    over = evaluate(facts["glm-4-9b"], h, PlanRequest(seq_len=32768, batch=lay.max_batch + 1), "auto", "auto", None, 1)
    assert at_max.fits and not over.fits


def test_glm5_does_not_fit_one_device_and_gets_a_sound_recommendation(facts):
    h = load_profile("nvidia-h200")
    result = plan(facts["glm-5"], h, PlanRequest(seq_len=32768, batch=8))
    assert not result.requested.fits and result.requested.max_batch == 0
    rec = result.recommendation
    assert rec is not None and rec.fits and rec.devices <= h.devices_per_node
    assert rec.kv_dtype in h.kv_cache_dtypes and rec.weight_dtype in h.weight_dtypes
    assert rec.sparse_kv_ratio is None or rec.sparse_kv_ratio >= 0.2  # lint rule sparse-kv-ratio-min
    assert rec.decode_tok_s > 0 and rec.bound in ("memory", "compute", "interconnect")
    assert any("MLA" in n for n in result.notes)
    json.dumps(result.to_dict())  # --json output is serialisable


@pytest.mark.parametrize("name, hardware", [("glm-4.5-air", "ascend-910b"), ("glm-4.5", "nvidia-h200"),
                                            ("glm-4-9b", "nvidia-a100-80g"), (DEFAULT, "ascend-310p")])
def test_recommendations_fit(facts, name, hardware):
    result = plan(facts[name], load_profile(hardware), PlanRequest(seq_len=32768, batch=8))
    assert result.recommendation is not None and result.recommendation.fits
    assert all(a.fits for a in result.alternatives)


def test_memory_bound_roofline_by_hand(facts):
    f, h = facts["glm-4-9b"], load_profile("nvidia-h200")
    lay = plan(f, h, PlanRequest(seq_len=4096, batch=1)).requested
    streamed = f.total_params * 2 - f.embedding_params * 2 + 4096 * lay.kv_bytes_per_token
    assert lay.bound == "memory"
    assert lay.decode_tok_s == pytest.approx(h.memory_bandwidth_gbps * 1e9 / streamed, rel=1e-6)


def test_tensor_parallel_splits_kv_heads_but_not_the_mla_latent(facts):
    h = load_profile("nvidia-h200")
    air = evaluate(facts["glm-4.5-air"], h, PlanRequest(), "auto", "auto", None, 4)
    one = evaluate(facts["glm-4.5-air"], h, PlanRequest(), "auto", "auto", None, 1)
    assert air.kv_bytes_per_token * 4 == one.kv_bytes_per_token
    glm5_8 = evaluate(facts["glm-5"], h, PlanRequest(), "int4", "auto", None, 8)
    glm5_1 = evaluate(facts["glm-5"], h, PlanRequest(), "int4", "auto", None, 1)
    assert glm5_8.kv_bytes_per_token == glm5_1.kv_bytes_per_token


def test_sparse_kv_and_quantized_kv_shrink_the_cache(facts):
    h = load_profile("ascend-910b")
    base = evaluate(facts["glm-4-9b"], h, PlanRequest(seq_len=32768), "auto", "auto", None, 1)
    sparse = evaluate(facts["glm-4-9b"], h, PlanRequest(seq_len=32768), "auto", "auto", 0.25, 1)
    int8 = evaluate(facts["glm-4-9b"], h, PlanRequest(seq_len=32768), "auto", "int8", None, 1)
    assert sparse.tokens_per_seq == 4 + 4096 + math.ceil(0.25 * (32768 - 4096 - 4))
    assert sparse.kv_bytes < base.kv_bytes and int8.kv_bytes < base.kv_bytes
    assert int8.kv_bytes_per_token_exact and not any("KV size is an estimate" in n for n in int8.notes)


def test_quantized_kv_bytes_equal_the_engines_store(facts):
    for dtype in ("int8", "int4"):
        spec = facts[DEFAULT].kv_spec
        cache = KVCache(spec, num_pages=2, page_size=16, dtype=dtype)
        assert kv_bytes_per_token(spec, dtype) == (cache.bytes_per_token(), True)


def test_seq_len_is_capped_at_the_model_context(facts):
    result = plan(facts[DEFAULT], detect_cpu(), PlanRequest(seq_len=32768, batch=1))
    assert result.requested.tokens_per_seq == 8192 and any("exceeds" in n for n in result.notes)


def test_model_sources_and_bad_input(tmp_path, facts):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SHAPES["glm-4-9b"]))
    assert inspect_model(str(path)).total_params == facts["glm-4-9b"].total_params
    assert inspect_model(str(tmp_path)).total_params == facts["glm-4-9b"].total_params
    with pytest.raises(ModelNotFoundError, match="built-in"):
        inspect_model("no-such-model")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(ModelFormatError, match="not supported"):
        inspect_model(str(tmp_path / "bad"))
    with pytest.raises(ConfigError, match="heads"):
        evaluate(facts[DEFAULT], load_profile("nvidia-h200"), PlanRequest(), "auto", "auto", None, 2)  # 9 heads


def test_plan_cli_json(capsys):
    from mlc.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "glm-4.5-air", "--hardware", "ascend-910b", "--seq-len", "16384", "--batch", "4",
              "--kv-dtype", "int8", "--json"])
    assert (e.value.code or 0) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["requested"]["kv_dtype"] == "int8" and data["request"]["seq_len"] == 16384
    assert data["model"]["total_params"] > 1e11 and data["recommendation"]["fits"]


def test_plan_cli_table_and_config(tmp_path, capsys):
    from mlc.cli.main import main

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("engine: {model: glm-4-9b, kv_cache_dtype: fp16, max_batch_size: 2, max_seq_len: 8192}\n")
    with pytest.raises(SystemExit) as e:
        main(["plan", "--config", str(cfg), "--hardware", "nvidia-a100-80g", "--batch", "4"])
    out = capsys.readouterr().out
    assert (e.value.code or 0) == 0
    assert "glm-4-9b" in out and "seq_len 8,192 x batch 4" in out and "recommended" in out


def test_recommendation_is_a_tensor_parallel_size_the_engine_can_shard(facts):
    from mlc.distributed.checks import check_shardable

    for name, hardware in (("glm-5", "nvidia-h200"), ("glm-4.5-air", "ascend-910b"), ("glm-4.5", "nvidia-h200")):
        result = plan(facts[name], load_profile(hardware), PlanRequest())
        rec = result.recommendation
        assert rec.tensor_parallel > 1 and rec.expert_parallel  # MoE experts spread whole over the ranks
        check_shardable(facts[name].hf_config, rec.tensor_parallel, rec.expert_parallel)
        assert f"--tensor-parallel-size {rec.tensor_parallel} --enable-expert-parallel" in result.command
    glm5 = plan(facts["glm-5"], load_profile("nvidia-h200"), PlanRequest())
    assert glm5.command.startswith("mlc-cli serve --model glm-5 --device cuda --tensor-parallel-size 8")
    # SmolLM2 has 9 heads: 2, 4 and 8 ranks cannot split them, so its plans never ask for them
    small = plan(facts[DEFAULT], load_profile("cpu"), PlanRequest(seq_len=4096))
    assert small.recommendation.tensor_parallel == 1 and "--tensor-parallel-size" not in small.command
    assert "--max-seq-len 4096" in small.command


def test_a_model_beyond_one_node_gets_pipeline_stages_in_its_command(facts):
    """GLM-5 on Ascend 310P nodes (4 devices each): tensor parallel inside a node, pipeline stages across."""
    result = plan(facts["glm-5"], load_profile("ascend-310p"), PlanRequest())
    rec = result.recommendation
    assert rec.pipeline_parallel > 1 and rec.tensor_parallel == 4
    assert f"--tensor-parallel-size 4 --pipeline-parallel-size {rec.pipeline_parallel}" in result.command
    assert any(f"tensor_parallel_size: 4, pipeline_parallel_size: {rec.pipeline_parallel}" in n
               for n in result.notes)  # across nodes through deploy
