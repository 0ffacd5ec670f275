"""`bench compare` end to end: find the peers, start the servers, run the workloads (bench/compare.py), then the
offline comparison with the servers stopped, and write JSON, a Markdown report and PNG plots."""

from __future__ import annotations

import json
import os
import platform
import time
from contextlib import ExitStack
from pathlib import Path

from mlc.bench import llama_cpp, peers
from mlc.bench.compare import CompareConfig, run_servers
from mlc.bench.gguf_source import describe_types, gguf_of, gguf_types
from mlc.bench.plots import cdf_plot, throughput_plot


def machine() -> dict:
    flags = ""
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
        name = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("model name")), platform.processor())
    except OSError:
        name = platform.processor()
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    return {"cpu": name, "cores": len(os.sched_getaffinity(0)), "flags": [f for f in wanted if f in flags.split()],
            "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def offline_prompt_ids(model: str, n: int) -> tuple[list[list[int]], Path, int]:
    """The prompts `bench offline` sends, as token ids under the model's chat template; its dir; a pad id."""
    from mlc.bench.prompts import chat_prompts
    from mlc.models.store import resolve_model_dir
    from mlc.models.tokenizer import load_tokenizer

    model_dir = resolve_model_dir(model)
    tok = load_tokenizer(model_dir)
    ids = []
    for conv in chat_prompts(n):
        x = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        ids.append(list(x["input_ids"]) if hasattr(x, "keys") else list(x))  # a BatchEncoding, or plain ids
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    return ids, model_dir, pad


def run_offline_peers(cfg: CompareConfig, progress) -> dict:
    """Our `LLM()` on its defaults against transformers generate and transformers continuous batching."""
    from mlc.bench.offline import run_offline
    from mlc.bench.offline_cb import run_transformers_cb
    from mlc.config.engine_config import EngineConfig

    rep = run_offline(EngineConfig(model=cfg.model), cfg.offline_prompts, cfg.max_tokens, peer_batch_size=8)
    out = rep.to_json()
    ids, model_dir, pad = offline_prompt_ids(cfg.model, cfg.offline_prompts)
    progress(f"offline: mlc {rep.ours_batch.tok_s:.1f} tok/s, transformers generate "
             f"{rep.peer_batch.tok_s if rep.peer_batch else float('nan'):.1f} tok/s")
    try:
        cb = run_transformers_cb(model_dir, ids, cfg.max_tokens, pad)
        out["transformers_cb"] = cb
        progress(f"offline: transformers continuous batching {cb['tok_s']:.1f} tok/s")
    except Exception as e:  # an optional peer: its failure is reported, the comparison goes on
        out["transformers_cb"] = {"error": f"{type(e).__name__}: {e}"}
        progress(f"offline: transformers continuous batching failed: {e}")
    return out


def start_server(stack: ExitStack, spec: peers.ServerSpec, notes: list[str], progress) -> peers.RunningServer:
    """Start `spec` inside `stack`; a llama-server that crashes while starting (its repacked weight layouts on some
    CPUs) is started again with --no-repack, and `notes` says so."""
    progress(f"starting {spec.label}")
    try:
        return stack.enter_context(peers.RunningServer(spec))
    except peers.ServerStartError as e:
        if not (e.crashed and spec.label.startswith("llama-server")):
            raise
        notes.append(f"{spec.label} crashed while starting (signal {e.signal}, log {spec.log}); it ran "
                     "with --no-repack instead (its repacked CPU weight layouts crash on this CPU)")
        progress(notes[-1])
        return stack.enter_context(peers.RunningServer(peers.without_repacking(spec)))


def run_compare(cfg: CompareConfig, progress=print) -> dict:
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    gguf = gguf_of(cfg.model)
    peer = None
    if gguf is None:
        notes.append(f"llama.cpp skipped: {cfg.model} does not come from a GGUF file, so there is no same-file peer")
    else:
        peer, note = llama_cpp.locate(cfg.llama_server, cfg.build_llama, progress)
        notes.append(note)
    threads = cfg.threads or len(os.sched_getaffinity(0))
    specs = [peers.ours(cfg.model, cfg.out_dir, cfg.ours_args)]
    if peer is not None and gguf is not None:
        parallel = max(cfg.concurrency)
        specs.append(peers.llama(peer.server, gguf, cfg.out_dir, threads, parallel, 1024 * parallel))
    result: dict = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(cfg).items()},
                    "machine": machine(), "notes": notes, "servers": {}}
    if gguf is not None:
        result["gguf"] = {"file": str(gguf), "types": describe_types(gguf_types(gguf))}
    with ExitStack() as stack:
        running = []
        for spec in specs:
            srv = start_server(stack, spec, notes, progress)
            result["servers"][srv.spec.label] = {"argv": srv.spec.argv, "startup_s": srv.startup_s,
                                                 "log": str(srv.spec.log)}
            running.append(srv)
        from mlc.models.store import resolve_model_dir
        from mlc.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(resolve_model_dir(cfg.model))
        result["workloads"] = run_servers(cfg, running, tokenizer, progress)
    if cfg.offline:
        result["offline"] = run_offline_peers(cfg, progress)
    else:
        notes.append("offline comparison skipped (--no-offline)")
    (cfg.out_dir / "compare.json").write_text(json.dumps(result, indent=2) + "\n")
    result["plots"] = [str(p) for p in write_plots(result, cfg.out_dir)]
    (cfg.out_dir / "compare.md").write_text(markdown(result))
    return result


def write_plots(result: dict, out_dir: Path) -> list[Path]:
    levels = result["workloads"]["concurrency"]
    paths = [throughput_plot({label: [(r["concurrency"], r["output_tok_s"]) for r in reps]
                              for label, reps in levels.items()},
                             out_dir / "throughput.png", "output tokens/s against concurrency (same GGUF)")]
    mid = sorted({r["concurrency"] for reps in levels.values() for r in reps})
    c = 8 if 8 in mid else mid[len(mid) // 2]
    for key, title in (("ttft", "time to first token"), ("e2e", "end-to-end latency")):
        paths.append(cdf_plot({label: next(r["samples_ms"][key] for r in reps if r["concurrency"] == c)
                               for label, reps in levels.items()},
                              out_dir / f"{key}-cdf-c{c}.png", f"{title} at concurrency {c}", f"{key.upper()} (ms)"))
    return paths


def _f(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def markdown(result: dict) -> str:
    """The report: one table per workload, ours first, the ratio to each peer in the last column."""
    w = result["workloads"]
    labels = list(result["servers"])
    ours, others = labels[0], labels[1:]
    lines = [f"Machine: {result['machine']['cpu']}, {result['machine']['cores']} cores "
             f"({', '.join(result['machine']['flags'])}); {result['machine']['time']}.", ""]
    if result.get("gguf"):
        lines += [f"GGUF: {Path(result['gguf']['file']).name}, {result['gguf']['types']}: every figure below is on "
                  "this format.", ""]
    lines += [f"- {n}" for n in result["notes"]] + [""]
    head = "| server | " + " | ".join(f"c={r['concurrency']} tok/s" for r in w["concurrency"][ours]) + \
        " | TPOT p50 c=1 ms | TTFT p50/p99 c=8 ms |"
    lines += ["### Concurrency (output tokens/s)", "", head, "|" + "---|" * (head.count("|") - 1)]
    for label in labels:
        reps = w["concurrency"][label]
        c1 = next((r for r in reps if r["concurrency"] == 1), None)
        c8 = next((r for r in reps if r["concurrency"] == 8), None)
        lines.append(f"| {label} | " + " | ".join(_f(r["output_tok_s"]) for r in reps) +
                     f" | {_f(c1['tpot_ms']['p50']) if c1 else '-'} | " +
                     (f"{_f(c8['ttft_ms']['p50'], 0)} / {_f(c8['ttft_ms']['p99'], 0)} |" if c8 else "- |"))
    for other in others:
        lines.append(f"| ratio mlc / {other.split()[0]} | " + " | ".join(
            _ratio(a["output_tok_s"], b["output_tok_s"]) for a, b in zip(w["concurrency"][ours],
                                                                        w["concurrency"][other])) + " | | |")
    if w["request_rate"]:
        lines += ["", f"### Poisson arrivals at {result['config']['request_rate']} requests/s", "",
                  "| server | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | ITL p50 | ITL p99 | E2E p50 | E2E p99 | "
                  "tok/s |", "|---|---|---|---|---|---|---|---|---|---|"]
        for label, r in w["request_rate"].items():
            cells = [_f(r[k][q], 0) for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms") for q in ("p50", "p99")]
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {_f(r['output_tok_s'])} |")
    lines += ["", "### Long prompt prefill", "", "| server | prompt tokens | best TTFT ms | prompt tok/s |",
              "|---|---|---|---|"]
    for label, r in w["prefill"].items():
        best = min(r["ttft_ms_runs"]) if r["ttft_ms_runs"] else None
        lines.append(f"| {label} | {r['prompt_tokens']} | {_f(best, 0)} | {_f(r['prompt_tok_s'])} |")
    lines += ["", "### Shared system prompt (prefix caching)", "",
              "| server | TTFT p50 unique ms | TTFT p50 shared ms | gain |", "|---|---|---|---|"]
    for label, r in w["shared_prefix"].items():
        lines.append(f"| {label} | {_f(r['unique']['ttft_ms']['p50'], 0)} | {_f(r['shared']['ttft_ms']['p50'], 0)}"
                     f" | {_f(r['ttft_gain'], 2)}x |")
    off = result.get("offline")
    if off:
        cb = off.get("transformers_cb") or {}
        peer = (off.get("peer_batch") or {}).get("tok_s")
        ours_row = f"mlc LLM() ({off['weights'].split(' (')[0]}, max_batch_size {off['max_batch_size']})"
        lines += ["", "### Offline (`LLM(model).generate`, defaults)", "", "| engine | tok/s | mlc ratio |",
                  "|---|---|---|", f"| {ours_row} | {_f(off['ours_batch']['tok_s'])} | |",
                  f"| transformers generate, batches of {off['peer_batch_size']} | {_f(peer)} | "
                  f"{_ratio(off['ours_batch']['tok_s'], peer)} |"]
        if "tok_s" in cb:
            lines.append(f"| transformers continuous batching | {_f(cb['tok_s'])} | "
                         f"{_ratio(off['ours_batch']['tok_s'], cb['tok_s'])} |")
        elif cb:
            lines.append(f"| transformers continuous batching | failed: {cb.get('error')} | |")
    lines += ["", "Plots: " + ", ".join(Path(p).name for p in result.get("plots", [])), ""]
    return "\n".join(lines)
