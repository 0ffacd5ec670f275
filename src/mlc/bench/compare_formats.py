"""`bench compare --formats Q4_0,Q4_K_M,...`: the comparison repeated on each GGUF format, so that a figure is never
quoted on one format alone (Q4_1, the default model's file, is llama.cpp's slow one on x86; Q4_0 and Q4_K_M are
its best and the files people download).

Each format's file is made from the model's GGUF by llama-quantize (with --allow-requantize where that file is
already quantized: both engines then read the same, requantized, values), and each gets a whole `bench compare` run
in its own folder. With `perplexity_chunks`, each format also gets its perplexity from our engine and from
llama-perplexity on the same file and text (bench/perplexity.py). formats.md / formats.json summarize them.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

from mlc.bench import llama_cpp
from mlc.bench.compare import CompareConfig, long_text
from mlc.bench.gguf_source import bytes_per_token, describe_types, gguf_of, gguf_types
from mlc.errors import ConfigError

_FLOAT = ("F32", "F16", "BF16")


def make_format(source: Path, fmt: str, out_dir: Path, quantize: Path) -> Path:
    """`source` as `fmt`, by llama-quantize (kept in `out_dir` for a rerun)."""
    dest = out_dir / f"{source.stem}-{fmt}.gguf"
    if dest.is_file():
        return dest
    out_dir.mkdir(parents=True, exist_ok=True)
    requant = [] if set(gguf_types(source)) <= set(_FLOAT) else ["--allow-requantize"]
    run = subprocess.run([str(quantize), *requant, str(source), str(dest), fmt], capture_output=True, text=True)
    if run.returncode != 0:
        dest.unlink(missing_ok=True)
        tail = " | ".join((run.stderr or run.stdout).strip().splitlines()[-3:])
        raise ConfigError(f"llama-quantize {fmt} failed: {tail}")
    return dest


def run_formats(cfg: CompareConfig, formats: list[str], perplexity_chunks: int, progress=print) -> dict:
    from mlc.bench.compare_run import run_compare

    source = gguf_of(cfg.model)
    if source is None:
        raise ConfigError(f"--formats needs a model that comes from a GGUF file; {cfg.model} does not")
    peer, note = llama_cpp.locate(cfg.llama_server, cfg.build_llama, progress)
    quantize = llama_cpp.tool("llama-quantize")
    if peer is None or quantize is None:
        raise ConfigError(f"--formats needs llama.cpp's llama-quantize ({note})")
    bandwidth = read_bandwidth_gb_s()
    progress(f"memory read bandwidth (2 GiB on 2 MiB pages, {torch_threads()} threads): {bandwidth:.1f} GB/s")
    summary: dict = {"source": str(source), "read_gb_s": bandwidth, "formats": {}}
    for i, fmt in enumerate(formats):
        path = source if fmt == "source" else make_format(source, fmt, cfg.out_dir / "gguf", quantize)
        label = describe_types(gguf_types(path))
        progress(f"format {fmt}: {path.name}, {label}")
        sub = dataclasses.replace(cfg, model=str(path), out_dir=cfg.out_dir / fmt, offline=cfg.offline and i == 0)
        result = run_compare(sub, progress)
        row = {"file": str(path), "types": label, "bytes_per_token": bytes_per_token(path), **ratios(result)}
        if perplexity_chunks:
            row["perplexity"] = perplexities(path, perplexity_chunks, progress)
        summary["formats"][fmt] = row
        (cfg.out_dir / "formats.json").write_text(json.dumps(summary, indent=2) + "\n")
        (cfg.out_dir / "formats.md").write_text(markdown(summary))
    return summary


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def read_bandwidth_gb_s(gib: int = 2, repeats: int = 5) -> float:
    """The machine's multi-threaded read bandwidth: the best of `repeats` sums over `gib` GiB placed on 2 MiB pages
    as the served weights are (csrc/huge_pages.h), with torch's threads (those the server computes with)."""

    import torch

    from mlc.layers.cpu_kernels import on_huge_pages

    buf = on_huge_pages(torch.ones(gib * 2**28))  # floats
    buf.sum()
    best = min(_timed(buf.sum) for _ in range(repeats))
    del buf
    return gib * 2**30 / best / 1e9


def _timed(fn) -> float:
    import time

    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def ratios(result: dict) -> dict:
    """mlc / llama.cpp per concurrency level, TPOT at c=1, prefill and TTFT ratios, from one compare run."""
    w = result["workloads"]
    labels = list(result["servers"])
    if len(labels) < 2:
        return {"note": "llama.cpp did not run"}
    ours, peer = labels[0], labels[1]
    out: dict = {"peer": peer, "tok_s": {}}
    for a, b in zip(w["concurrency"][ours], w["concurrency"][peer]):
        out["tok_s"][a["concurrency"]] = [a["output_tok_s"], b["output_tok_s"]]
        if a["concurrency"] == 1:
            out["tpot_ms_c1"] = [a["tpot_ms"]["p50"], b["tpot_ms"]["p50"]]
            out["ttft_ms_c1"] = [a["ttft_ms"]["p50"], b["ttft_ms"]["p50"]]
    out["prefill_tok_s"] = [w["prefill"][ours]["prompt_tok_s"], w["prefill"][peer]["prompt_tok_s"]]
    return out


def perplexities(path: Path, chunks: int, progress) -> dict:
    from mlc.bench import perplexity
    from mlc.engine.llm import LLM

    text = long_text()
    ours = perplexity.ours(LLM(str(path)), text, limit=chunks)
    binary = llama_cpp.tool("llama-perplexity")
    theirs = perplexity.llama_cpp(binary, path, text, limit=chunks) if binary else None
    progress(f"perplexity over {ours.chunks} chunks of 512: mlc {ours.value:.4f}, llama.cpp "
             f"{theirs.value if theirs else float('nan'):.4f}")
    return {"chunks": ours.chunks, "ctx": 512, "mlc": ours.value, "llama_cpp": theirs.value if theirs else None}


def _x(pair) -> str:
    a, b = pair if pair else (None, None)
    return f"{a / b:.2f}x" if a and b else "-"


def markdown(summary: dict) -> str:
    levels = sorted({int(c) for row in summary["formats"].values() for c in row.get("tok_s", {})})
    head = ("| format | matrices | " + " | ".join(f"c={c} mlc / llama.cpp tok/s" for c in levels)
            + " | TPOT c=1 ms mlc / llama.cpp | bandwidth c=1 mlc / llama.cpp | TTFT c=1 | prefill "
            "| perplexity mlc / llama.cpp |")
    lines = [f"Source: {summary['source']}; memory read bandwidth {summary['read_gb_s']:.1f} GB/s.", "", head,
             "|" + "---|" * (head.count("|") - 1)]
    for fmt, row in summary["formats"].items():
        tok = row.get("tok_s", {})
        cells = [f"{_x(tok.get(c) or tok.get(str(c)))} ({_pair(tok.get(c) or tok.get(str(c)))})" for c in levels]
        ppl = row.get("perplexity") or {}
        ppl_cell = (f"{ppl['mlc']:.3f} / {ppl['llama_cpp']:.3f}" if ppl.get("llama_cpp") else
                    f"{ppl['mlc']:.3f} / -" if ppl else "-")
        lines.append(f"| {fmt} | {row['types']} | " + " | ".join(cells) +
                     f" | {_pair(row.get('tpot_ms_c1'))} | {_bandwidth(row, summary['read_gb_s'])} | "
                     f"{_x(_inverse(row.get('ttft_ms_c1')))} | {_x(row.get('prefill_tok_s'))} | {ppl_cell} |")
    lines += ["", "Ratios are mlc / llama.cpp (TTFT: llama.cpp's time / ours, so above 1 is ours faster). Bandwidth: "
              "the weight bytes a decode step reads (every matrix; the embedding only as a tied head; of MoE experts, "
              "the routed share) / TPOT at c=1, as a share of the measured read bandwidth.", ""]
    return "\n".join(lines)


def _bandwidth(row: dict, read_gb_s: float) -> str:
    tpot = row.get("tpot_ms_c1")
    if not tpot or not tpot[0] or not tpot[1]:
        return "-"
    share = [row["bytes_per_token"] / (t / 1000) / 1e9 / read_gb_s for t in tpot]
    return f"{100 * share[0]:.0f}% / {100 * share[1]:.0f}%"


def _pair(pair) -> str:
    return f"{pair[0]:.1f} / {pair[1]:.1f}" if pair and pair[0] and pair[1] else "-"


def _inverse(pair):
    return (pair[1], pair[0]) if pair else None
