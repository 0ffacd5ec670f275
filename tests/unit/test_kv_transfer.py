"""Prefill/decode disaggregation in one process: a prefill engine's pages, leased and exported, continue the request
on a decode engine token for token as one engine would (tiny GQA llama, GLM-4.5 MoE, GLM-5 MLA + DSA, and the
default model), and the lease protocol: expiry, abort before the pull, a failed transfer recomputed, a prefix hit on
the decoder pulling fewer pages, and pages freed exactly once."""

from __future__ import annotations

import pytest

from mlc.config.engine_config import EngineConfig
from mlc.engine.kv_transfer import KVHandle, pack_bytes
from mlc.engine.llm_engine import LLMEngine
from mlc.engine.sampling_params import SamplingParams
from tests.numerics.test_decode_parity import PAGE_SIZE, build_checkpoint, prompts

STEPS = 24


def run(engine: LLMEngine, rid: str) -> list[int]:
    """Step until `rid` finishes; its tokens."""
    for _ in range(500):
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return list(out.outputs[0].token_ids)
    raise AssertionError(f"{rid} did not finish")


def prefill(p: LLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> KVHandle:
    p.prefill_for_transfer(rid, prompt, params)
    run(p, rid)
    handle = p.kv_handle(rid)
    assert handle is not None
    return handle


def pd_generate(p: LLMEngine, d: LLMEngine, rid: str, prompt: list[int], params: SamplingParams,
                fail: bool = False) -> list[int]:
    handle = prefill(p, rid, prompt, params)
    assert set(handle.pages) == {name for layer in p.kv_cache.layers for name in layer}  # every KV group
    pending = d.begin_import(rid, prompt, params, handle)
    assert pending is not None
    buf = None if fail else p.export_kv(rid, pending.hit_pages)
    assert p.release_kv(rid)
    first = d.finish_import(rid, buf)
    if first and first[0].finished:
        return list(first[0].outputs[0].token_ids)
    return run(d, rid)


def engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="fp32", page_size=PAGE_SIZE, kv_cache_memory=8 << 20, **kw))


def audit(engine: LLMEngine) -> None:
    assert engine.recovery.audit() == []


def greedy(n: int = STEPS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "glm4_moe", "glm_moe_dsa"])
def tiny(request, tmp_path_factory):
    path = build_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    make = lambda: engine(path)  # noqa: E731
    return make(), make(), make()


def test_1p1d_greedy_tokens_equal_one_engine(tiny):
    p, d, alone = tiny
    vocab = p.model.config.vocab_size
    for i, prompt in enumerate(prompts(vocab)):
        alone.add_request(f"a{i}", prompt, greedy())
        want = run(alone, f"a{i}")
        assert pd_generate(p, d, f"r{i}", prompt, greedy()) == want
    for e in tiny:
        audit(e)
    assert p.page_manager.num_free_pages == p.page_manager.usable_pages
    assert d.kv.stats.imports == len(prompts(vocab)) and d.kv.stats.imports_recomputed == 0


def test_seeded_sampling_continues_draw_for_draw(tiny):
    p, d, alone = tiny
    prompt = prompts(p.model.config.vocab_size)[1]
    seeded = SamplingParams(max_tokens=STEPS, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    alone.add_request("sa", prompt, seeded)
    assert pd_generate(p, d, "sd", prompt, seeded) == run(alone, "sa")


def test_failed_transfer_recomputes_on_the_decoder(tiny):
    p, d, alone = tiny
    prompt = prompts(p.model.config.vocab_size)[2]
    alone.add_request("fa", prompt, greedy())
    want = run(alone, "fa")
    assert pd_generate(p, d, "fail", prompt, greedy(), fail=True) == want
    assert d.kv.stats.imports_recomputed >= 1
    audit(d)


def llama_engines(tmp_path, **kw):
    path = build_checkpoint("llama", tmp_path)
    return [engine(path, **kw)
            for _ in range(2)]


def test_lease_expires_once_and_abort_before_pull_frees_the_pages(tmp_path):
    p, d = llama_engines(tmp_path, kv_lease_timeout=0.05)
    pm = p.page_manager
    prompt = list(range(10, 60))
    prefill(p, "x", prompt, greedy())
    held = pm.usable_pages - pm.num_free_pages
    assert held == pm.pages_for(len(prompt)) and len(p.kv.leases) == 1
    audit(p)
    assert p.kv.expire(now=float("inf")) == ["x"]
    assert p.kv.expire(now=float("inf")) == [] and not p.release_kv("x")  # freed exactly once
    assert pm.num_free_pages == pm.usable_pages and p.kv.stats.leases_expired == 1
    with pytest.raises(KeyError):
        p.export_kv("x")  # an expired lease has nothing to give: the decoder recomputes
    prefill(p, "y", prompt, greedy())
    assert p.abort("y") is None and not p.kv.leases  # the client gave up before the decoder pulled
    assert pm.num_free_pages == pm.usable_pages
    audit(p)
    # an abort on D while its pull is in flight frees the reserved pages; the late bytes are dropped
    handle = prefill(p, "z", prompt, greedy())
    pending = d.begin_import("z", prompt, greedy(), handle)
    assert pending is not None
    out = d.abort("z")
    assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
    assert d.finish_import("z", p.export_kv("z")) == []
    assert d.page_manager.num_free_pages == d.page_manager.usable_pages
    audit(d)


def test_prefix_hit_on_the_decoder_pulls_fewer_pages(tmp_path):
    p, d = llama_engines(tmp_path)
    shared = list(range(10, 10 + 3 * PAGE_SIZE))
    d.add_request("warm", shared + [7, 8, 9], greedy(2))
    run(d, "warm")  # D now caches the shared pages
    prompt = shared + list(range(200, 220))
    handle = prefill(p, "q", prompt, greedy())
    pending = d.begin_import("q", prompt, greedy(), handle)
    assert pending is not None and pending.hit_pages == 3
    assert len(pending.src_pages) == len(handle.page_ids) - 3
    buf = p.export_kv("q", pending.hit_pages)
    assert buf.numel() == pack_bytes(d.kv_cache, len(handle.page_ids) - 3)
    p.release_kv("q")
    d.finish_import("q", buf)
    got = run(d, "q")
    p.add_request("solo", prompt, greedy())
    assert got == run(p, "solo")


def test_mismatched_format_or_unfit_request_computes_on_the_decoder(tmp_path):
    path = build_checkpoint("llama", tmp_path)
    p = engine(path)
    d = engine(path, kv_cache_dtype="int8")
    prompt = list(range(10, 40))
    handle = prefill(p, "m", prompt, greedy())
    assert d.begin_import("m", prompt, greedy(), handle) is None  # int8 pages cannot take fp32 ones
    assert len(run(d, "m")) == STEPS
    p.kv.exportable = False  # a tensor-parallel engine: this process holds only its ranks' heads
    p.prefill_for_transfer("tp", prompt, greedy())
    run(p, "tp")
    assert p.kv_handle("tp") is None and "tp" not in p.kv.leases
    p.kv.exportable = True
    lp = SamplingParams(max_tokens=3, temperature=0.0, logprobs=1)
    assert d.begin_import("lp", prompt, lp, handle) is None  # the first token's logprob stayed on P
    assert len(run(d, "lp")) == 3


def test_quantized_kv_pages_transfer_between_int8_engines(tmp_path):
    path = build_checkpoint("llama", tmp_path)
    make = lambda: engine(path, kv_cache_dtype="int8")  # noqa: E731
    p, d, alone = make(), make(), make()
    prompt = list(range(10, 80))
    alone.add_request("a", prompt, greedy())
    assert pd_generate(p, d, "b", prompt, greedy()) == run(alone, "a")
    assert d.kv.stats.bytes_received == pack_bytes(p.kv_cache, p.page_manager.pages_for(len(prompt)))


def test_default_model_1p1d_matches_one_engine(default_model_dir):
    make = lambda: LLMEngine(EngineConfig(model=str(default_model_dir), kv_cache_memory=64 << 20))  # noqa: E731
    p, d = make(), make()
    prompt = p.encode("The capital of France is Paris. The capital of Italy is")
    p.add_request("solo", prompt, greedy(12))
    want = run(p, "solo")
    assert pd_generate(p, d, "pd", prompt, greedy(12)) == want
