"""`mlc-cli bench quant`: weight dtypes compared on one model (memory, load time, decode speed, quality)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from mlc.cli.engine_options import option

console = Console()


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def speed_table(r) -> Table:
    t = Table(title=f"bench quant: {r.model}, {r.threads} thread(s), {r.decode_tokens} decode tokens, "
                    f"median of {r.repeats}; load average {r.load_average[0]:.1f}")
    for col in ("variant", "weights MB", "load s", "quantize s", "RSS float MiB", "RSS MiB", "b1 tok/s",
                "b8 tok/s", f"b1 / {r.peer.name.split(',')[0]}", "kernels"):
        t.add_column(col, justify="left" if col in ("variant", "kernels") else "right")
    for v in r.variants:
        t.add_row(v.label, _fmt(v.weight_bytes / 1e6), _fmt(v.load_s, 2), _fmt(v.quantize_s, 2),
                  _fmt(v.rss_float_mib, 0), _fmt(v.rss_mib, 0), _fmt(v.decode_b1_tok_s), _fmt(v.decode_b8_tok_s),
                  f"{v.decode_b1_tok_s / r.peer.tok_s:.2f}x", ", ".join(f"{k} x{n}" for k, n in v.kernels.items()))
    return t


def quality_table(r) -> Table:
    base = r.baseline()
    contexts = list(base.needle or {}) if base else []
    t = Table(title="quality vs fp32 (same harness, same prompts, greedy)")
    for col in ("variant", "perplexity", "ppl vs fp32", "greedy agreement", *[f"needle {c}" for c in contexts]):
        t.add_column(col, justify="left" if col == "variant" else "right")
    for v in r.variants:
        delta = f"{100 * (v.perplexity / base.perplexity - 1):+.2f}%" if base and v.perplexity else "-"
        needles = [_fmt((v.needle or {}).get(c), 2) for c in contexts]
        t.add_row(v.label, _fmt(v.perplexity, 3), delta, _fmt(v.agreement, 3), *needles)
    return t


def kernel_table(rows) -> Table:
    """One row per kernel and shape, one column per batch size: median us per call (relative error)."""
    batches = sorted({r.batch for r in rows})
    t = Table(title="quant kernels: median us per call (relative error vs fp32)")
    t.add_column("kernel")
    t.add_column("K x N", justify="right")
    for m in batches:
        t.add_column(f"M={m}", justify="right")
    cells: dict[tuple, dict[int, str]] = {}
    for r in rows:
        cells.setdefault((r.kernel, f"{r.in_features}x{r.out_features}"), {})[r.batch] = (
            f"{r.us:.0f} ({r.rel_error:.1e})")
    for (kernel, shape), by_m in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        t.add_row(kernel, shape, *[by_m.get(m, "-") for m in batches])
    return t


def _kernels(threads: int | None, stream_mb: int, json_out: Path | None) -> None:
    from dataclasses import asdict

    from mlc.bench.quant_kernels import run_kernel_bench

    with console.status("timing kernels"):
        rows = run_kernel_bench(threads=threads, stream_mb=stream_mb)
    console.print(kernel_table(rows))
    if json_out:
        json_out.write_text(json.dumps([asdict(r) for r in rows], indent=2))
        console.print(f"wrote {json_out}")


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("quant")
    def quant(
        model: Annotated[str, option("model")] = "smollm2-135m-instruct",
        variants: Annotated[str, typer.Option(
            help="Comma-separated: fp32, fp16, bf16, int8 (mixed), int8-w8a8, int8-w8a16, int8-w8a8i (per-token "
            "int8 activations, exact integer GEMM), int4 (g32), int4-g64.")
        ] = "fp32,fp16,bf16,int8,int8-w8a8,int8-w8a16,int4,int4-g64",
        decode_tokens: Annotated[int, typer.Option("--decode-tokens", min=2)] = 64,
        repeats: Annotated[int, typer.Option(min=1, help="Decode runs per measure; the median is reported.")] = 3,
        threads: Annotated[int | None, typer.Option(min=1, help="torch threads (default: torch's).")] = None,
        quick: Annotated[bool, typer.Option("--quick", help="A few-minute quality subset.")] = False,
        no_quality: Annotated[bool, typer.Option("--no-quality", help="Speed and memory only.")] = False,
        no_peer: Annotated[bool, typer.Option("--no-peer", help="Skip llama.cpp.")] = False,
        device: Annotated[str, option("device")] = "cpu",
        json_out: Annotated[Path | None, typer.Option("--json", help="Write the report as JSON.")] = None,
        plot: Annotated[Path | None, typer.Option(help="Write the memory-vs-quality PNG here.")] = None,
        kernels: Annotated[bool, typer.Option("--kernels", help="Only the kernel micro-benchmark.")] = False,
        stream_mb: Annotated[int, typer.Option(
            "--stream-mb", min=0, help="--kernels: cycle weight copies of this many fp32 MB (0: hot cache).")] = 256,
    ) -> None:
        """Each weight dtype in a fresh process: memory, load time, decode tok/s at batch 1 and 8, quality."""
        from mlc.bench.quant import (
            QualityPlan,
            parse_variant,
            plot_tradeoff,
            run_quant_bench,
        )

        if not console.is_terminal:  # a log file: do not wrap the tables to 80 columns
            console.width = 180

        if kernels:
            return _kernels(threads, stream_mb, json_out)

        chosen = [parse_variant(v.strip()) for v in variants.split(",") if v.strip()]
        plan = None if no_quality else QualityPlan.quick() if quick else QualityPlan()
        from mlc.cli.progress import progress_bar

        with progress_bar() as bar:
            task = bar.add_task("bench quant: variants", total=len(chosen))

            def progress(v) -> None:  # a long run shows each variant as it lands
                ppl = f", perplexity {v.perplexity:.3f}" if v.perplexity else ""
                console.print(f"{v.label}: {v.weight_bytes / 1e6:.0f} MB, b1 {v.decode_b1_tok_s:.1f} tok/s, "
                              f"b8 {v.decode_b8_tok_s:.1f} tok/s{ppl}", highlight=False)
                bar.advance(task)

            report = run_quant_bench(model, chosen, device, threads, decode_tokens, repeats, plan, not no_peer,
                                     on_variant=progress)
        console.print(speed_table(report))
        peer = report.peer
        console.print(f"{peer.name}: {peer.tok_s:.1f} tok/s ({peer.note})", highlight=False)
        if plan is not None:
            console.print(quality_table(report))
        if json_out:
            json_out.write_text(json.dumps(report.to_json(), indent=2))
            console.print(f"wrote {json_out}")
        if plot and plan is not None:
            console.print(f"wrote {plot_tradeoff(report, plot)}")
