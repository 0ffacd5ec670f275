"""`bench scale`: the size ladder. Random-weight GGUFs of real shapes (models/synth.py: Llama, GLM-4-0414 and a
GLM-4.5-style MoE, from a few hundred million parameters to 3B, 8B/9B on request) served by `mlc-cli serve` and by
llama-server on the same file, interleaved, one rung at a time, each rung on a quiet machine:

  concurrency      the chats at each level (output tok/s, TPOT)
  prefill          one long prompt at each length (prompt tok/s from the best of three TTFTs)
  background load  c=1 again beside a process that keeps `background_load` of one core busy, and without it,
                   back to back: what a little noise on the machine costs one stream
  memory           each server's peak RSS (VmHWM) over the rung
  roofline         weight bytes a decode step reads x tok/s at c=1, as a share of the read bandwidth measured
                   just before the rung's servers start

scale.json is rewritten after every rung (a long ladder keeps what it measured); scale.md and the PNGs at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlc.bench import llama_cpp, peers
from mlc.bench.compare import (
    CompareConfig,
    chat_prompts_for,
    long_text,
    model_ids,
    run_levels,
    run_prefill,
    warm_up,
    words_for_tokens,
)
from mlc.bench.compare_formats import read_bandwidth_gb_s
from mlc.bench.compare_run import machine, start_server
from mlc.bench.gguf_source import bytes_per_token, describe_types, gguf_types
from mlc.errors import ConfigError

DEFAULT_RUNGS = ("llama-360M", "llama-1B", "llama-3B", "glm4-0.5B", "glm4-1.5B", "glm4-3B", "glm4moe-2B")
LARGE_RUNGS = ("llama-8B", "glm4-9B")  # --large: a few GB each, and minutes a level at c=1
_BUSY = """
import time, sys
duty, period = float(sys.argv[1]), 0.1
while True:
    end = time.perf_counter() + duty * period
    while time.perf_counter() < end:
        pass
    time.sleep(period * (1 - duty))
"""


@dataclass
class ScaleConfig:
    out_dir: Path
    rungs: list[str] = field(default_factory=lambda: list(DEFAULT_RUNGS))
    quant: str = "Q4_0"
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    num_prompts: int = 8  # at c=1; a level of c runs max(this, 2c) requests
    max_tokens: int = 48
    prefill_tokens: list[int] = field(default_factory=lambda: [512, 4096])
    background_load: float = 0.05  # of one core; 0 skips that workload
    synthetic_dir: Path | None = None  # default: $MLC_HOME/synthetic
    llama_server: Path | None = None
    build_llama: bool = True
    threads: int | None = None
    ours_args: list[str] = field(default_factory=list)
    seed: int = 0


def check_rungs(rungs: list[str]) -> None:
    from mlc.models.synth import SHAPES

    unknown = [r for r in rungs if r not in SHAPES]
    if unknown:
        raise ConfigError(f"unknown rung(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")


def synthetic_file(cfg: ScaleConfig, rung: str, progress) -> Path:
    """The rung's GGUF, written once into the synthetic folder and reused by later runs."""
    from mlc.config.paths import mlc_home
    from mlc.models import synth

    path = (cfg.synthetic_dir or mlc_home() / "synthetic") / f"{rung}-{cfg.quant}.gguf"
    if path.is_file():
        return path
    shape = synth.SHAPES[rung]
    progress(f"{rung}: writing a random-weight {cfg.quant} GGUF ({shape.like}) to {path}")
    tool = llama_cpp.tool("llama-quantize") if cfg.quant.upper() in synth.MIXES else None
    partial = path.with_name(path.name + ".partial")
    try:
        synth.synthesize(shape, cfg.quant, partial, cfg.seed, tool)
    except BaseException:
        partial.unlink(missing_ok=True)  # a full disk or ^C leaves no half-written file behind
        raise
    partial.rename(path)
    return path


class BackgroundLoad:
    """A child process that keeps `share` of one core busy (spins share x 100 ms in every 100 ms)."""

    def __init__(self, share: float) -> None:
        self.share = share
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> BackgroundLoad:
        self.proc = subprocess.Popen([sys.executable, "-c", _BUSY, str(self.share)])
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def _requests(cfg: ScaleConfig, level: int) -> int:
    """Requests at a concurrency level: `num_prompts`, and at least twice the level."""
    return max(cfg.num_prompts, 2 * level)


def run_rung(cfg: ScaleConfig, rung: str, peer, progress) -> dict:
    from mlc.models import synth
    from mlc.models.store import resolve_model_dir
    from mlc.models.tokenizer import load_tokenizer

    path = synthetic_file(cfg, rung, progress)
    shape = synth.SHAPES[rung]
    out_dir = cfg.out_dir / rung
    ccfg = CompareConfig(model=str(path), out_dir=out_dir, concurrency=cfg.concurrency,
                         num_prompts=max(_requests(cfg, c) for c in cfg.concurrency),
                         max_tokens=cfg.max_tokens, threads=cfg.threads, ours_args=cfg.ours_args, seed=cfg.seed,
                         offline=False, request_rate=None)
    bandwidth = read_bandwidth_gb_s()
    progress(f"{rung}: memory read bandwidth {bandwidth:.1f} GB/s")
    threads = cfg.threads or len(os.sched_getaffinity(0))
    parallel = max(cfg.concurrency)
    specs = [peers.ours(str(path), out_dir, cfg.ours_args),
             peers.llama(peer.server, path, out_dir, threads, parallel, max(1024 * parallel,
                                                                            2 * max(cfg.prefill_tokens)))]
    row: dict = {"rung": rung, "arch": shape.arch, "like": shape.like, "file": str(path),
                 "types": describe_types(gguf_types(path)), "file_bytes": path.stat().st_size,
                 "params": shape.params(), "active_params": shape.params(active=True),
                 "bytes_per_token": bytes_per_token(path), "read_gb_s": bandwidth, "notes": [], "servers": {}}
    with ExitStack() as stack:
        servers = [start_server(stack, spec, row["notes"], progress) for spec in specs]
        labels = [s.spec.label for s in servers]
        row["labels"] = {"mlc": labels[0], "llama.cpp": labels[1]}
        tokenizer = load_tokenizer(resolve_model_dir(str(path)))
        mid = model_ids(servers)
        _, chats = chat_prompts_for(ccfg)
        warm_up(servers, mid, chats, ccfg.max_tokens)
        levels: dict[str, list[dict]] = {label: [] for label in labels}
        for i, level in enumerate(cfg.concurrency):  # enough requests for the level to run full for a while
            for label, got in run_levels(ccfg, servers, mid, chats[:_requests(cfg, level)], [level], progress,
                                         i).items():
                levels[label] += got
        text = long_text()
        prefill = {n: run_prefill(ccfg, servers, mid, words_for_tokens(text, n, tokenizer), progress, i)
                   for i, n in enumerate(cfg.prefill_tokens)}
        background: dict[str, dict] = {}
        if cfg.background_load > 0:
            few = chats[:_requests(cfg, 1)]
            quiet = run_levels(ccfg, servers, mid, few, [1], progress)
            with BackgroundLoad(cfg.background_load):
                busy = run_levels(ccfg, servers, mid, few, [1], progress, step=1)
            background = {label: {"quiet_tok_s": quiet[label][0]["output_tok_s"],
                                  "loaded_tok_s": busy[label][0]["output_tok_s"]} for label in labels}
        for s, (engine, label) in zip(servers, row["labels"].items()):
            by_level = {r["concurrency"]: r for r in levels[label]}
            c1 = by_level.get(1)
            row["servers"][engine] = {
                "label": label, "argv": s.spec.argv, "startup_s": s.startup_s,
                "tok_s": {c: r["output_tok_s"] for c, r in by_level.items()},
                "tpot_ms_c1": c1["tpot_ms"]["p50"] if c1 else None,
                "prefill_tok_s": {n: p[label]["prompt_tok_s"] for n, p in prefill.items()},
                "background": background.get(label),
                "peak_rss_bytes": s.peak_rss_bytes()}
    for srv in row["servers"].values():
        tok1 = srv["tok_s"].get(1)
        srv["roofline"] = row["bytes_per_token"] * tok1 / (bandwidth * 1e9) if tok1 else None
    return row


def run_scale(cfg: ScaleConfig, progress=print) -> dict:
    check_rungs(cfg.rungs)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    peer, note = llama_cpp.locate(cfg.llama_server, cfg.build_llama, progress)
    if peer is None:
        raise ConfigError(f"bench scale compares with llama-server on the same files: {note}")
    result: dict = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
                    "machine": machine(), "notes": [note], "rungs": {}}
    for rung in cfg.rungs:
        result["rungs"][rung] = run_rung(cfg, rung, peer, progress)
        (cfg.out_dir / "scale.json").write_text(json.dumps(result, indent=2) + "\n")
    from mlc.bench.scale_report import markdown, write_plots

    result["plots"] = [str(p) for p in write_plots(result, cfg.out_dir)]
    (cfg.out_dir / "scale.json").write_text(json.dumps(result, indent=2) + "\n")
    (cfg.out_dir / "scale.md").write_text(markdown(result))
    return result
