"""`mlc-cli bench kv`: KV-cache dtypes x sparse-KV ratios: memory, capacity, decode speed and quality (table, JSON,
PNG). `register(bench_app)` adds the command to the `bench` group."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from mlc.config.engine_config import parse_size
from mlc.errors import ConfigError

console = Console()


def parse_list(text: str, cast, name: str, shape: str = "values separated by commas") -> tuple:
    try:
        items = tuple(cast(x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{name} {text!r}: write {shape}") from None
    if not items:
        raise ConfigError(f"{name} is empty")
    return items


def _pair(text: str) -> tuple[str, float]:
    dtype, sep, ratio = text.partition(":")
    if not sep:
        raise ValueError(text)
    return dtype, float(ratio)


def _cell(value, fmt: str = "{:.1f}") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def kv_table(report) -> Table:
    p = report.plan
    table = Table(title=f"bench kv: {p.model} (budget {p.budget_bytes / 2**30:g} GiB, {p.capacity_context}-token "
                        f"sequences; sparse window {p.window}, min_context {p.min_context}, sinks {p.sink_tokens})")
    for name in ("KV", "ratio", "B/token/layer", "B/token", "entries @ctx", "mem saved", "max seqs",
                 "decode tok/s", "ppl", "Δppl %", "agree", *(f"needle {c // 1024}K" for c in p.needle_contexts)):
        table.add_column(name, justify="left" if name == "KV" else "right")
    for r in report.rows:
        layer = sorted(set(r.bytes_per_token_layer))
        table.add_row(
            r.dtype, f"{r.ratio:g}", "/".join(str(b) for b in layer), str(r.bytes_per_token),
            str(r.entries_at_capacity_context), f"{100 * report.memory_saved(r):.0f}%", str(r.max_sequences),
            _cell(r.decode_tok_s), _cell(r.perplexity, "{:.3f}"), _cell(r.perplexity_delta_pct, "{:+.2f}"),
            _cell(r.agreement, "{:.3f}"), *(_cell(r.needle.get(c), "{:.2f}") for c in p.needle_contexts),
        )
    return table


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("kv")
    def bench_kv(
        model: Annotated[str, typer.Option("--model", "-m", help="Store name or checkpoint dir.")] =
            "smollm2-135m-instruct",
        dtypes: Annotated[str, typer.Option(help="KV dtypes, comma separated.")] = "fp32,fp16,bf16,int8,int4",
        ratios: Annotated[str, typer.Option(help="Sparse-KV ratios (1 = full KV), comma separated.")] =
            "1,0.5,0.25,0.1",
        also: Annotated[Optional[str], typer.Option(help="More dtype:ratio pairs besides the grid, e.g. int4:0.25.")]
            = None,
        quick: Annotated[bool, typer.Option("--quick", help="Shorter text, fewer prompts, needles at 2K/4K.")] = False,
        no_quality: Annotated[bool, typer.Option("--no-quality", help="Memory and capacity only (seconds).")] = False,
        speed_only: Annotated[bool, typer.Option("--speed-only", help="Perplexity and decode tok/s, no agreement "
                                                 "or needles (to re-measure speed).")] = False,
        window: Annotated[int, typer.Option(help="Sparse KV: recent tokens kept whole.")] = 512,
        min_context: Annotated[int, typer.Option(help="Sparse KV: tokens before thinning starts.")] = 1024,
        sink_tokens: Annotated[int, typer.Option(help="Sparse KV: first tokens always kept.")] = 4,
        budget: Annotated[str, typer.Option(help="KV budget for the capacity column, e.g. 1GiB.")] = "1GiB",
        context: Annotated[int, typer.Option(help="Sequence length for the capacity column.")] = 8192,
        needle_contexts: Annotated[Optional[str], typer.Option(help="Needle context lengths, e.g. 2048,4096,7168.")]
            = None,
        needle_trials: Annotated[Optional[int], typer.Option(help="Needle depths per context length.")] = None,
        agreement_prompts: Annotated[Optional[int], typer.Option(help="Greedy-agreement prompts.")] = None,
        ppl_tokens: Annotated[Optional[int], typer.Option(help="Tokens of the long text to score (default all).")]
            = None,
        from_json: Annotated[Optional[Path], typer.Option("--from-json", help="Print and plot an earlier kv.json "
                                                          "instead of running.")] = None,
        threads: Annotated[Optional[int], typer.Option(help="CPU threads (1 is faster on a busy machine).")] = None,
        output: Annotated[Path, typer.Option(
            "--out", "-o", "--output", help="Directory for kv.json and kv.png.")] =
            Path("bench-kv"),
    ) -> None:
        """KV bytes/token, max sequences in a budget, decode tok/s and quality vs fp32 full KV, per dtype and ratio."""
        from mlc.bench.kv import KVBenchPlan, KVBenchReport, plot_tradeoff, run_kv_bench

        if from_json is not None:
            try:
                report = KVBenchReport.from_json(json.loads(from_json.read_text()))
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"--from-json {from_json}: not a bench kv report ({e})") from None
            console.print(kv_table(report))
            output.mkdir(parents=True, exist_ok=True)
            console.print(f"wrote {plot_tradeoff(report, output / 'kv.png')}")
            return

        try:
            budget_bytes = parse_size(budget)
        except ValueError as e:
            raise ConfigError(f"--budget: {e}") from None
        overrides: dict[str, Any] = dict(
            model=model, dtypes=parse_list(dtypes, str, "--dtypes"), ratios=parse_list(ratios, float, "--ratios"),
            window=window, min_context=min_context, sink_tokens=sink_tokens, budget_bytes=budget_bytes,
            capacity_context=context, quality=not (no_quality or speed_only), speed=not no_quality,
        )
        if also:
            overrides["extra"] = parse_list(also, _pair, "--also", "dtype:ratio pairs, e.g. int8:0.25,int4:0.25")
        if needle_contexts:
            overrides["needle_contexts"] = parse_list(needle_contexts, int, "--needle-contexts")
        for key, value in (("needle_trials", needle_trials), ("agreement_prompts", agreement_prompts),
                           ("ppl_tokens", ppl_tokens)):
            if value is not None:
                overrides[key] = value
        plan = KVBenchPlan.quick(**overrides) if quick else KVBenchPlan(**overrides)
        plan.check()
        if threads:
            import torch

            torch.set_num_threads(threads)
        with console.status("bench kv: loading the model") as status:
            def on_row(row):
                status.update(f"bench kv: {row.label} done in {row.seconds:.0f} s")
                console.print(f"  {row.label}: {row.bytes_per_token} B/token, {row.max_sequences} sequences, "
                              f"ppl {_cell(row.perplexity, '{:.3f}')}, {row.seconds:.0f} s", highlight=False)

            report = run_kv_bench(plan, on_row)
        console.print(kv_table(report))
        if report.load_average:
            console.print(f"load average after the run: {', '.join(f'{x:.2f}' for x in report.load_average)} "
                          "(decode tok/s is noisy on a shared machine)", highlight=False)
        output.mkdir(parents=True, exist_ok=True)
        (output / "kv.json").write_text(json.dumps(report.to_json(), indent=2, default=str))
        console.print(f"wrote {output / 'kv.json'}")
        if plan.quality:
            console.print(f"wrote {plot_tradeoff(report, output / 'kv.png')}")
