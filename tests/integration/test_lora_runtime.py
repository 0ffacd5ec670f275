"""LoRA adapters loaded and unloaded while the engine serves (issue 31): use counts, per-batch and in-memory
capacity, the rank bound, a prefix cache keyed by the adapter's contents, and the batched LoRA step."""

from __future__ import annotations

import json

import pytest
import torch

from mlc.bench.lora_synth import write_random_adapter
from mlc.config.engine_config import EngineConfig
from mlc.engine.llm_engine import LLMEngine
from mlc.engine.lora_manager import AdapterConflictError
from mlc.engine.sampling_params import SamplingParams
from mlc.errors import CapacityError, ModelNotFoundError
from mlc.layers import lora as lora_layer
from mlc.layers.lora import LoRALinear
from mlc.layers.lora_files import AdapterError
from tests.support.tiny_llama import build_tiny_llama

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 33, 70, 12, 8], [100, 3, 44], [7, 7, 8, 200, 31, 2, 90, 17, 5]]
LONG = list(range(40, 80))  # several full pages: the prefix cache keeps them


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_rt")
    base = build_tiny_llama(root / "base")
    adapters = {
        "a": write_random_adapter(root / "a", base, rank=8, seed=1, std=0.3),
        "b": write_random_adapter(root / "b", base, rank=4, seed=2, std=0.3, targets=("q_proj", "v_proj")),
        "c": write_random_adapter(root / "c", base, rank=6, seed=3, std=0.3, rslora=True,
                                  targets=("o_proj", "down_proj", "up_proj")),
        "a2": write_random_adapter(root / "a2", base, rank=8, seed=11, std=0.3),  # a changed "a"
        "r16": write_random_adapter(root / "r16", base, rank=16, seed=4),
    }
    return base, adapters


def engine(base, **kw):
    return LLMEngine(EngineConfig(model=str(base), kv_cache_memory="8MiB", **kw))


def run(eng, jobs):
    """jobs: request id -> (prompt, adapter id); returns request id -> greedy tokens."""
    for rid, (prompt, adapter) in jobs.items():
        eng.add_request(rid, prompt, GREEDY, adapter_id=adapter)
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def only(base, name, path, prompts=PROMPTS):
    """Greedy replies of an engine that had only this adapter from the start."""
    eng = engine(base, lora_adapters={name: str(path)})
    return run(eng, {f"{i}": (p, 1) for i, p in enumerate(prompts)})


def test_loaded_at_run_time_equals_loaded_at_start(dirs):
    base, ad = dirs
    eng = engine(base)
    plain = run(eng, {"p": (PROMPTS[0], 0)})
    eng.add_request("during", PROMPTS[2], GREEDY)  # a request in flight while the adapter loads
    eng.step()
    aid = eng.add_lora("c", str(ad["c"]))
    got = run(eng, {f"{i}": (p, aid) for i, p in enumerate(PROMPTS)} | {"p2": (PROMPTS[0], 0)})
    assert {k: v for k, v in got.items() if k not in ("p2", "during")} == only(base, "c", ad["c"])
    assert got["p2"] == plain["p"] and got["during"] == run(engine(base), {"x": (PROMPTS[2], 0)})["x"]


def test_unload_is_refused_while_in_use_then_frees_everything(dirs):
    base, ad = dirs
    eng = engine(base)
    aid = eng.add_lora("a", str(ad["a"]))
    eng.add_request("r", PROMPTS[0], GREEDY, adapter_id=aid)
    with pytest.raises(AdapterConflictError, match="1 request"):
        eng.remove_lora("a")  # waiting
    eng.step()
    with pytest.raises(AdapterConflictError) as e:
        eng.remove_lora("a")  # running
    assert e.value.http_status == 409
    while eng.has_unfinished():
        eng.step()
    eng.remove_lora("a")
    assert eng.adapter_ids == {} and not any(isinstance(m, LoRALinear) for m in eng.model.modules())
    with pytest.raises(ModelNotFoundError):
        eng.adapter_id("a")
    with pytest.raises(ModelNotFoundError, match="no longer loaded"):
        eng.add_request("late", PROMPTS[0], GREEDY, adapter_id=aid)  # ids are never reused
    with pytest.raises(ModelNotFoundError, match="no LoRA adapter named"):
        eng.remove_lora("a")


def test_name_taken_and_bad_adapters_leave_the_loaded_ones_serving(dirs, tmp_path):
    base, ad = dirs
    eng = engine(base, max_lora_rank=8)
    aid = eng.add_lora("a", str(ad["a"]))
    before = run(eng, {"x": (PROMPTS[0], aid)})["x"]
    with pytest.raises(AdapterConflictError, match="already loaded"):
        eng.add_lora("a", str(ad["b"]))
    with pytest.raises(AdapterError, match="--max-lora-rank 8") as e:
        eng.add_lora("big", str(ad["r16"]))
    assert e.value.http_status == 400
    other = tmp_path / "other_base"  # a model like this one but for its MLP width
    other.mkdir()
    cfg = json.loads((base / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(cfg | {"intermediate_size": 48}))
    with pytest.raises(AdapterError, match="another base"):
        eng.add_lora("wrongbase", str(write_random_adapter(tmp_path / "wb", other, seed=6)))
    weird = write_random_adapter(tmp_path / "weird", base, seed=7, targets=("q_proj",))
    raw = (weird / "adapter_model.safetensors").read_bytes().replace(b"q_proj", b"x_proj")
    (weird / "adapter_model.safetensors").write_bytes(raw)
    with pytest.raises(AdapterError, match="x_proj"):
        eng.add_lora("weird", str(weird))
    trunc = write_random_adapter(tmp_path / "trunc", base, seed=8)
    data = (trunc / "adapter_model.safetensors").read_bytes()
    (trunc / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterError, match="truncated"):
        eng.add_lora("trunc", str(trunc))
    with pytest.raises(AdapterError, match="adapter_config.json"):
        eng.add_lora("empty", str(tmp_path))
    (tmp_path / "bad_json").mkdir()
    (tmp_path / "bad_json" / "adapter_config.json").write_text("{nope")
    with pytest.raises(AdapterError, match="not valid JSON"):
        eng.add_lora("bad_json", str(tmp_path / "bad_json"))
    assert list(eng.adapter_ids) == ["a"] and run(eng, {"y": (PROMPTS[0], aid)})["y"] == before


def test_reload_under_the_same_name_never_reuses_stale_kv(dirs):
    base, ad = dirs
    eng = engine(base)
    first = eng.add_lora("a", str(ad["a"]))
    run(eng, {"v1": (LONG, first)})
    hits = eng.page_manager.prefix_hits
    eng.remove_lora("a")
    second = eng.add_lora("a", str(ad["a2"]))  # other weights, same name
    got = run(eng, {"v2": (LONG, second)})["v2"]
    assert eng.page_manager.prefix_hits == hits  # nothing of v1's pages matched
    assert got == only(base, "a", ad["a2"], [LONG])["0"]
    eng.remove_lora("a")
    third = eng.add_lora("a", str(ad["a2"]))  # the same files again: their pages may be reused
    assert run(eng, {"v3": (LONG, third)})["v3"] == got
    assert eng.page_manager.prefix_hits > hits


def test_more_adapters_than_batch_slots_wait_instead_of_failing(dirs):
    base, ad = dirs
    eng = engine(base, max_loras=1)
    ids = {n: eng.add_lora(n, str(ad[n])) for n in ("a", "b", "c")}
    jobs = {f"{n}{i}": (p, ids[n]) for n in ids for i, p in enumerate(PROMPTS)}
    jobs |= {f"base{i}": (p, 0) for i, p in enumerate(PROMPTS)}
    for rid, (prompt, adapter) in jobs.items():
        eng.add_request(rid, prompt, GREEDY, adapter_id=adapter)
    done, widest, mixed = {}, 0, False
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        in_batch = {s.adapter_id for s in eng.scheduler.running if s.adapter_id}
        widest = max(widest, len(in_batch))
        mixed = mixed or bool(in_batch and any(not s.adapter_id for s in eng.scheduler.running))
    assert widest == 1 and mixed and len(done) == len(jobs)  # the base model is no adapter: it rides along
    for n, path in (("a", ad["a"]), ("c", ad["c"])):
        alone = only(base, n, path)
        assert [done[f"{n}{i}"] for i in range(3)] == [alone[str(i)] for i in range(3)]


def test_least_recently_used_adapter_is_evicted_unless_pinned_or_busy(dirs):
    base, ad = dirs
    eng = engine(base, max_cpu_loras=2, lora_adapters={"a": str(ad["a"])})  # --lora adapters are pinned
    eng.add_lora("b", str(ad["b"]))
    cid = eng.add_lora("c", str(ad["c"]))  # evicts b, never the pinned a
    assert sorted(eng.adapter_ids) == ["a", "c"] and eng.loras.evicted == {"b": str(ad["b"])}
    with pytest.raises(AdapterError):
        eng.add_lora("big", str(ad["r16"]) + "-missing")  # a refused adapter evicts nobody
    assert sorted(eng.adapter_ids) == ["a", "c"]
    eng.add_request("busy", PROMPTS[0], GREEDY, adapter_id=cid)
    with pytest.raises(CapacityError, match="pinned or in use"):
        eng.add_lora("b", str(ad["b"]))
    while eng.has_unfinished():
        eng.step()
    eng.add_lora("b", str(ad["b"]), pinned=True)
    assert sorted(eng.adapter_ids) == ["a", "b"] and "c" in eng.loras.evicted


@pytest.mark.parametrize("gather_rows", [0, 1 << 20])
def test_batched_step_equals_the_per_adapter_path(dirs, monkeypatch, gather_rows):
    """Segments (0) and gather + batched matmul (everything) both give each adapter's own greedy tokens, and
    logits within float rounding of the unbatched per-pair formula."""
    base, ad = dirs
    monkeypatch.setattr(lora_layer, "GATHER_MAX_ROWS", gather_rows)
    eng = engine(base)
    ids = {n: eng.add_lora(n, str(ad[n])) for n in ("a", "b", "c")}
    jobs = {f"{n}{i}": (p, ids[n]) for n in ids for i, p in enumerate(PROMPTS)}
    jobs |= {f"base{i}": (p, 0) for i, p in enumerate(PROMPTS)}
    done = run(eng, jobs)
    for n in ids:
        alone = only(base, n, ad[n])
        assert [done[f"{n}{i}"] for i in range(3)] == [alone[str(i)] for i in range(3)]
    plain = run(engine(base), {f"{i}": (p, 0) for i, p in enumerate(PROMPTS)})
    assert [done[f"base{i}"] for i in range(3)] == [plain[str(i)] for i in range(3)]
    wrapper = eng.model.model.layers[0].self_attn.qkv_proj
    x = torch.randn(5, 32)
    rows = {ids["a"]: torch.tensor([0, 3]), ids["b"]: torch.tensor([1, 4])}
    with torch.inference_mode(), lora_layer.lora_rows(rows):
        got = wrapper(x)
    want = wrapper.base(x)
    for aid, idx in rows.items():
        for d in wrapper.deltas[aid]:
            want[idx, d.start : d.stop] += d.scale * (x[idx] @ d.a.t()) @ d.b.t()
    assert (got - want).abs().max().item() < 1e-5
