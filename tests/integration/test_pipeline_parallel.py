"""Pipeline parallelism on the CPU (two stages, two processes, hidden states over gloo point-to-point): greedy
tokens identical to the plain engine over DECODE_STEPS steps, alone and in a batch, for a tiny llama (GQA), a tiny
GLM-4.5 MoE and a tiny GLM-5 (MLA latents + DSA indexer keys, the stage boundary on a full indexer layer), and for
the default model on its default path (GGUF blocks, bf16, fused decode layers on each stage); and with two
tensor-parallel ranks in each stage (four processes), experts split or spread. Also: the batch
queue at depth 1 gives the same tokens, and a request aborted while its step is in flight leaves the others
intact, and a stage that dies ends the engine with EngineDeadError."""

from __future__ import annotations

import json

import pytest

from mlc.engine.llm import LLM
from mlc.engine.sampling_params import SamplingParams
from tests.numerics.test_decode_parity import DECODE_STEPS, PAGE_SIZE, build_checkpoint, greedy, prompts
from tests.support.kernel_marks import needs_cpu_kernels

KV = "4MiB"


def plain_run(arch: str, tmp_path_factory):
    """A tiny checkpoint of `arch`, its prompts, and the plain engine's greedy tokens (alone = batched)."""
    path = build_checkpoint(arch, tmp_path_factory.mktemp(arch))
    batch = prompts(json.loads((path / "config.json").read_text())["vocab_size"])
    plain = LLM(str(path), dtype="fp32", page_size=PAGE_SIZE, kv_cache_memory=KV)
    want = greedy(plain, batch)
    assert [greedy(plain, [p])[0] for p in batch] == want
    return path, batch, want


@pytest.fixture(scope="module", params=["llama", "glm4_moe", "glm_moe_dsa"])
def tiny(request, tmp_path_factory):
    return plain_run(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=["glm4_moe", "glm_moe_dsa"])
def tiny_moe(request, tmp_path_factory):
    return plain_run(request.param, tmp_path_factory)


def test_two_stages_decode_the_plain_engines_greedy_tokens_alone_and_in_a_batch(tiny):
    path, batch, want = tiny
    llm = LLM(str(path), dtype="fp32", page_size=PAGE_SIZE, kv_cache_memory=KV, pipeline_parallel_size=2)
    try:
        assert "pipeline parallel 2" in llm.engine.weights
        assert greedy(llm, batch) == want
        assert [greedy(llm, [p])[0] for p in batch] == want
        busy = llm.engine.pipeline.utilization()
        assert len(busy) == 2 and all(t > 0 and n > 0 for t, n in busy)
    finally:
        llm.engine.shutdown()


def two_by_two(path, monkeypatch, expert_parallel: bool = False) -> LLM:
    """2 stages x 2 TP ranks: four processes, each stage's heads (and experts) split over its two ranks."""
    from mlc.distributed import checks

    monkeypatch.setattr(checks, "devices_available", lambda device: 4)  # two cores here: the processes share them
    return LLM(str(path), dtype="fp32", page_size=PAGE_SIZE, kv_cache_memory=KV, pipeline_parallel_size=2,
               tensor_parallel_size=2, enable_expert_parallel=expert_parallel, num_threads=1)


def test_stages_of_two_tensor_parallel_ranks_decode_the_same_greedy_tokens(tmp_path, monkeypatch):
    path = build_checkpoint("llama", tmp_path)
    batch = prompts(json.loads((path / "config.json").read_text())["vocab_size"])
    want = greedy(LLM(str(path), dtype="fp32", page_size=PAGE_SIZE, kv_cache_memory=KV), batch)
    llm = two_by_two(path, monkeypatch)
    try:
        assert "tensor parallel 2; pipeline parallel 2" in llm.engine.weights
        assert greedy(llm, batch) == want
        assert [greedy(llm, [p])[0] for p in batch] == want
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_moe_and_dsa_stages_of_two_tensor_parallel_ranks_decode_the_same_greedy_tokens(tiny_moe, expert_parallel,
                                                                                      monkeypatch):
    path, batch, want = tiny_moe
    llm = two_by_two(path, monkeypatch, expert_parallel)
    try:
        assert greedy(llm, batch) == want
        assert [greedy(llm, [p])[0] for p in batch] == want
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_a_batch_queue_of_depth_one_gives_the_same_tokens(tmp_path):
    path = build_checkpoint("glm4_moe", tmp_path)
    batch = prompts(json.loads((path / "config.json").read_text())["vocab_size"])
    want = greedy(LLM(str(path), dtype="fp32", page_size=PAGE_SIZE, kv_cache_memory=KV), batch)
    llm = LLM(str(path), dtype="fp32", page_size=PAGE_SIZE, kv_cache_memory=KV, pipeline_parallel_size=2,
              pipeline_depth=1)
    try:
        assert greedy(llm, batch) == want
    finally:
        llm.engine.shutdown()


def test_a_request_aborted_while_in_flight_leaves_the_others_intact(tmp_path):
    path = build_checkpoint("llama", tmp_path)
    batch = prompts(json.loads((path / "config.json").read_text())["vocab_size"]) * 2
    want = greedy(LLM(str(path), dtype="fp32", page_size=PAGE_SIZE, kv_cache_memory=KV), batch)
    llm = LLM(str(path), dtype="fp32", page_size=PAGE_SIZE, kv_cache_memory=KV, pipeline_parallel_size=2)
    eng = llm.engine
    params = SamplingParams(max_tokens=DECODE_STEPS, temperature=0.0, ignore_eos=True)
    try:
        for i, p in enumerate(batch):
            eng.add_request(f"r{i}", p, params)
        for _ in range(4):
            eng.step()
        flying = {s.request_id for s in eng.scheduler.running if s.seq_id in eng.pipeline.in_flight}
        assert flying, "a micro-batch is in flight after a step"
        victim = sorted(flying)[0]
        assert eng.abort(victim).finished
        done = {}
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        assert victim not in done
        assert {rid: done[rid] for rid in done} == {f"r{i}": want[i] for i in range(len(batch)) if f"r{i}" != victim}
        assert eng.page_manager.audit([]) == []
    finally:
        eng.shutdown()


@pytest.mark.slow
@needs_cpu_kernels
def test_the_default_model_on_two_stages_decodes_its_own_greedy_tokens(default_model_dir):
    """SmolLM2-135M from its GGUF: Q4_1 blocks, bf16 activations and the fused decode layers, 15 layers a stage."""
    texts = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):", "List three colors:"]
    plain = LLM(str(default_model_dir), kv_cache_memory="64MiB")
    batch = [plain.engine.encode(t) for t in texts]
    want = greedy(plain, batch)
    llm = LLM(str(default_model_dir), kv_cache_memory="64MiB", pipeline_parallel_size=2)
    try:
        assert llm.engine.model.stage_layers == (0, 15)
        assert greedy(llm, batch) == want
        assert [greedy(llm, [p])[0] for p in batch] == want
        assert llm.engine.model.decode_plans, "stage 0 ran its layers fused"
    finally:
        llm.engine.shutdown()


def test_a_stage_that_dies_ends_the_engine_cleanly(tmp_path):
    from mlc.errors import EngineDeadError

    path = build_checkpoint("llama", tmp_path)
    llm = LLM(str(path), dtype="fp32", page_size=PAGE_SIZE, kv_cache_memory=KV, pipeline_parallel_size=2)
    eng = llm.engine
    try:
        eng.add_request("r", [5, 9, 33, 70], SamplingParams(max_tokens=8, temperature=0.0))
        eng.step()
        eng.tp_group.procs[0].kill()
        eng.tp_group.procs[0].wait()
        with pytest.raises(EngineDeadError, match="pipeline-parallel worker lost: rank 1 exited"):
            while eng.has_unfinished():
                eng.step()
        with pytest.raises(EngineDeadError):
            eng.check_alive()
    finally:
        eng.shutdown()
