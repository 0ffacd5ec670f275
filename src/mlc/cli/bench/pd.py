"""`mlc-cli bench pd transfer|ab`: the KV transfer of one long context, and colocated vs prefill/decode serving."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from mlc.cli.engine_options import EngineArgs, engine_options

console = Console()


def register(bench_app: typer.Typer) -> None:
    pd_app = typer.Typer(help="Prefill/decode disaggregation: KV transfer cost, and colocated vs 1P+1D serving.",
                         no_args_is_help=True)

    @pd_app.command("transfer")
    @engine_options()
    def transfer(
        context: Annotated[int, typer.Option("--context", help="Context tokens whose KV pages move "
                                             "(clipped to the model's context).")] = 8192,
        reps: Annotated[int, typer.Option("--reps", help="Timed repetitions per phase (medians).")] = 5,
        prefill: Annotated[bool, typer.Option("--prefill/--no-prefill", help="Fill the pages with a real prefill "
                                              "of the context (slow on CPU); off: move the pages as allocated.")
                           ] = True,
        json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the report as JSON.")] = None,
        *,
        engine: EngineArgs,
    ) -> None:
        """The KV pages of one context moved P -> D: pack, gloo send to another process, unpack; against a plain
        copy of the same bytes in memory."""
        from mlc.bench.pd import run_transfer

        cfg = engine.resolve()
        with console.status(f"prefilling {context} tokens" if prefill else "allocating pages"):
            r = run_transfer(cfg, context, reps, prefill)
        t = Table(title=f"bench pd transfer: {r.model}, {r.context_tokens} tokens, {r.pages} pages, "
                        f"{r.bytes / 2**20:.1f} MiB{' (prefilled)' if r.prefilled else ''}")
        for col in ("phase", "ms", "GB/s"):
            t.add_column(col, justify="right")
        phases = (("pack (cache -> buffer)", r.pack_ms), ("gloo send -> recv, other process", r.gloo_ms),
                  ("  first (builds the pair group)", r.first_gloo_ms), ("unpack (buffer -> pages)", r.unpack_ms),
                  ("total (pack + gloo + unpack)", r.total_ms), ("loopback memcpy of the bytes", r.memcpy_ms))
        for name, ms in phases:
            t.add_row(name, f"{ms:.1f}", f"{r.rate(ms):.2f}")
        console.print(t)
        if json_out:
            json_out.write_text(json.dumps(r.to_json(), indent=2))
            console.print(f"wrote {json_out}")

    @pd_app.command("ab")
    def ab(
        model: Annotated[str, typer.Option("--model")] = "smollm2-135m-instruct",
        duration: Annotated[float, typer.Option("--duration", help="Seconds of load per run (two layouts, each "
                                                "without long prompts and at each --long-rate).")] = 60.0,
        chat_rate: Annotated[float, typer.Option("--chat-rate", help="Short chats per second.")] = 1.0,
        long_rate: Annotated[str, typer.Option("--long-rate", help="Long prompts per second (Poisson); a list such "
                                               "as 0.05,0.1,0.2 runs each (and always a run without).")] = "0.1",
        long_tokens: Annotated[int, typer.Option("--long-tokens")] = 4096,
        chat_max_tokens: Annotated[int, typer.Option("--chat-max-tokens")] = 64,
        threshold: Annotated[int, typer.Option("--threshold", help="The PD router's remote-prefill threshold "
                                               "(tokens).")] = 512,
        cores: Annotated[Optional[str], typer.Option("--cores", help="CPU ids to split between the two instances "
                                                     "of each layout, e.g. 0-7 (default: all).")] = None,
        log_dir: Annotated[Path, typer.Option("--log-dir")] = Path("bench-pd-logs"),
        json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the reports as JSON.")] = None,
        plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG of the short chats' TPOT p99 "
                                                     "against the share of long prompts.")] = None,
    ) -> None:
        """2 colocated replicas vs 1 prefill + 1 decode instance, at equal cores: short chats alone, then with
        Poisson long prompts at each rate; the short chats' decode TPOT p99 per layout."""
        from dataclasses import asdict

        from mlc.bench.pd import ABConfig, ab_plot, long_share, run_ab
        from mlc.errors import ConfigError

        ids: list[int] = []
        for part in (cores or "").split(","):
            if part.strip():
                lo, _, hi = part.partition("-")
                try:
                    ids += list(range(int(lo), int(hi or lo) + 1))
                except ValueError:
                    raise ConfigError(f"--cores {cores!r}: give CPU ids like 0-7 or 0,2,4") from None
        try:
            rates = [float(x) for x in long_rate.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--long-rate {long_rate!r}: give prompts per second, e.g. 0.1 or 0.05,0.1,0.2") from None
        if not rates or any(r <= 0 for r in rates):
            raise ConfigError(f"--long-rate {long_rate!r}: give one or more rates above 0 (a run without long "
                              "prompts is always made)")
        cfg = ABConfig(model, duration, chat_rate, rates, long_tokens, chat_max_tokens, threshold)
        if ids:
            cfg.cores = ids
        t = Table(title=f"bench pd ab: {model}, chats {chat_rate}/s x {chat_max_tokens} tokens, long prompts "
                        f"{long_tokens} tokens at {long_rate}/s, {duration:.0f}s per run")
        for col in ("layout", "long/s", "long %", "chats", "longs", "errors", "chat TPOT p50 ms", "chat TPOT p99 ms",
                    "p99 vs no long", "chat TTFT p50 ms", "chat TTFT p99 ms", "long TTFT p50 ms", "out tok/s"):
            t.add_column(col, justify="right")
        base: dict[str, float] = {}

        def show(r) -> None:
            if r.long_rate == 0:
                base[r.layout] = r.chat_tpot_p99_ms
            ratio = r.chat_tpot_p99_ms / base[r.layout] if base.get(r.layout) else float("nan")
            t.add_row(r.layout, f"{r.long_rate:g}", f"{100 * long_share(r):.0f}", str(r.chats), str(r.longs),
                      str(r.errors),
                      f"{r.chat_tpot_p50_ms:.1f}", f"{r.chat_tpot_p99_ms:.1f}", f"{ratio:.2f}x",
                      f"{r.chat_ttft_p50_ms:.0f}", f"{r.chat_ttft_p99_ms:.0f}", f"{r.long_ttft_p50_ms:.0f}",
                      f"{r.output_tok_s:.1f}")
            console.print(f"{r.layout} long/s={r.long_rate:g}: chat TPOT p99 {r.chat_tpot_p99_ms:.1f} ms")
            if r.errors:
                console.print(f"[yellow]{r.errors} request(s) failed[/]; the first: {r.first_error}", highlight=False)

        reports = run_ab(cfg, log_dir, show)
        console.print(t)
        if json_out:
            rows = [{k: None if isinstance(v, float) and v != v else v for k, v in asdict(r).items()} for r in reports]
            json_out.write_text(json.dumps(rows, indent=2))  # a statistic with no sample is null, not NaN
            console.print(f"wrote {json_out}")
        if plot:
            ab_plot(reports, plot, f"{model}: chats {chat_rate}/s, long prompts of {long_tokens} tokens")
            console.print(f"wrote {plot}")

    bench_app.add_typer(pd_app, name="pd")
