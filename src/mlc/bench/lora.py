"""`mlc-cli bench lora`: the goals of issue 31, in process on the engine (no HTTP in the way).

- Throughput: `streams` concurrent greedy streams of `tokens` tokens each, on the base model, all on one adapter,
  and each on its own adapter (`streams` distinct adapters in one batch); decode tokens/s of each, and the ratios
  the goals name (one adapter / base >= 0.85, distinct / one adapter >= 0.9).
- Load latency while serving: base streams decode while adapters load as the server loads them (files read on
  another thread, the slot written between two steps); the median load time (goal <= 100 ms) and the longest
  step gap while loading against the p99 gap without loads (goal <= 2x).

Adapters are random PEFT adapters (`lora_synth.py`) of rank `rank` on every linear layer, written to a temp dir.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mlc.bench.lora_synth import write_random_adapter


@dataclass
class LoRABenchConfig:
    model: str
    streams: int = 32
    tokens: int = 64
    rank: int = 8
    loads: int = 8  # adapters loaded while the base streams decode
    kv_cache_memory: str = "512MiB"
    engine: dict[str, Any] = field(default_factory=dict)  # more EngineConfig keys


def _prompts(n: int) -> list[list[int]]:
    return [[1 + (7 * i + j) % 500 for j in range(16 + i % 8)] for i in range(n)]


def _throughput(engine, prompts: list[list[int]], adapter_ids: list[int], tokens: int) -> dict[str, float]:
    from mlc.engine.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, (prompt, aid) in enumerate(zip(prompts, adapter_ids)):
        engine.add_request(f"t{time.monotonic_ns()}-{i}", prompt, params, adapter_id=aid)
    start = time.perf_counter()
    first_decode = None
    tokens_before = decode_from = engine.generation_tokens
    while engine.has_unfinished():
        engine.step()
        if first_decode is None and engine.generation_tokens - tokens_before >= len(prompts):
            first_decode, decode_from = time.perf_counter(), engine.generation_tokens  # prefills done
    end = time.perf_counter()
    decode_tokens = engine.generation_tokens - decode_from
    decode_s = end - (first_decode or start)
    return {"seconds": round(end - start, 3), "decode_tokens_per_s": round(decode_tokens / max(decode_s, 1e-9), 1),
            "tokens_per_s": round((engine.generation_tokens - tokens_before) / (end - start), 1)}


def _loads_while_serving(engine, prompts: list[list[int]], paths: list[Path], tokens: int) -> dict[str, float]:
    """As the server loads: the files read and checked on another thread while the steps go on, then the slot
    written between two steps. Load time: from asking to the adapter being servable."""
    from concurrent.futures import ThreadPoolExecutor

    from mlc.engine.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"l{i}", prompt, params)
    gaps: list[float] = []
    load_gaps: list[float] = []
    load_ms: list[float] = []
    install_ms: list[float] = []
    pending = list(paths)
    loading = None  # (name, path, future, started)
    last = None
    step = 0
    with ThreadPoolExecutor(1) as pool:
        while engine.has_unfinished():
            busy = loading is not None
            if loading is None and step >= 3 and pending:  # past the prefills
                path = pending.pop()
                loading = (f"load{len(pending)}", path, pool.submit(engine.prepare_lora, str(path)),
                           time.perf_counter())
                busy = True
            elif loading is not None and loading[2].done():
                name, path, future, started = loading
                t = time.perf_counter()
                engine.add_lora(name, str(path), prepared=future.result())
                install_ms.append((time.perf_counter() - t) * 1e3)
                load_ms.append((time.perf_counter() - started) * 1e3)
                loading = None
            engine.step()
            now = time.perf_counter()
            if last is not None and step >= 3:
                (load_gaps if busy else gaps).append((now - last) * 1e3)
            last = now
            step += 1
    p99 = sorted(gaps)[max(0, int(len(gaps) * 0.99) - 1)] if gaps else 0.0
    worst = max(load_gaps, default=0.0)
    return {"loads": len(load_ms), "load_ms_median": round(statistics.median(load_ms), 1) if load_ms else 0.0,
            "load_ms_max": round(max(load_ms, default=0.0), 1),
            "install_ms_median": round(statistics.median(install_ms), 1) if install_ms else 0.0,
            "gap_ms_p99_without_loads": round(p99, 1), "gap_ms_max_while_loading": round(worst, 1),
            "gap_ratio": round(worst / p99, 2) if p99 else 0.0}


def run_lora_bench(cfg: LoRABenchConfig, progress: Callable[[str], None] = print) -> dict[str, Any]:
    from mlc.config.engine_config import EngineConfig
    from mlc.engine.llm_engine import LLMEngine
    from mlc.models.store import resolve_model_dir

    model_dir = resolve_model_dir(cfg.model)
    prompts = _prompts(cfg.streams)
    result: dict[str, Any] = {"config": asdict(cfg)}
    with tempfile.TemporaryDirectory(prefix="mlc-bench-lora-") as tmp:
        count = max(cfg.streams, cfg.loads)
        progress(f"writing {count} random rank-{cfg.rank} adapters on every linear layer")
        paths = [write_random_adapter(Path(tmp) / f"a{i}", model_dir, rank=cfg.rank, seed=i) for i in range(count)]
        engine = LLMEngine(EngineConfig(**{"model": cfg.model, "kv_cache_memory": cfg.kv_cache_memory,
                                           "max_batch_size": max(cfg.streams, 1), **cfg.engine}))
        progress(f"base model: {cfg.streams} streams x {cfg.tokens} tokens")
        _throughput(engine, prompts[:2], [0, 0], 2)  # warm-up
        result["base"] = _throughput(engine, prompts, [0] * cfg.streams, cfg.tokens)
        progress(f"  {result['base']}")
        progress(f"loading adapters while {cfg.streams} base streams decode")
        result["load_while_serving"] = _loads_while_serving(engine, prompts, paths[: cfg.loads], cfg.tokens)
        progress(f"  {result['load_while_serving']}")
        for name in list(engine.adapter_ids):
            engine.remove_lora(name)
        ids = [engine.add_lora(f"a{i}", str(p)) for i, p in enumerate(paths[: cfg.streams])]
        progress("one adapter for every stream")
        result["one_adapter"] = _throughput(engine, prompts, [ids[0]] * cfg.streams, cfg.tokens)
        progress(f"  {result['one_adapter']}")
        progress(f"{cfg.streams} distinct adapters in the batch")
        result["distinct_adapters"] = _throughput(engine, prompts, ids, cfg.tokens)
        progress(f"  {result['distinct_adapters']}")
    base, one, many = (result[k]["decode_tokens_per_s"] for k in ("base", "one_adapter", "distinct_adapters"))
    result["ratios"] = {"one_adapter_vs_base": round(one / base, 3) if base else 0.0,
                        "distinct_vs_one_adapter": round(many / one, 3) if one else 0.0}
    return result
