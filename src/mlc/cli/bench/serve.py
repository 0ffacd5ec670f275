"""`mlc-cli bench serve`: load a running OpenAI-compatible server over HTTP (TTFT, TPOT, ITL, E2E, goodput)."""

from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mlc.errors import InvalidRequestError

console = Console()


def parse_levels(text: str, flag: str = "--concurrency") -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidRequestError(f"{flag} {text!r}: write integers separated by commas, e.g. 1,8,32") from None
    if not levels or min(levels) < 1:
        raise InvalidRequestError(f"{flag} {text!r}: every value must be at least 1")
    return levels


def _cell(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def serve_table(model: str, reports, slo: bool) -> Table:
    """One column per concurrency level, one row per measure (fits a terminal for any number of levels)."""
    table = Table(title=f"bench serve: {model}")
    table.add_column("measure")
    for r in reports:
        table.add_column(f"concurrency {r.concurrency}", justify="right")
    rows: list[tuple[str, list[str]]] = [
        ("completed / failed", [f"{r.completed} / {r.failed}" for r in reports]),
        ("duration s", [_cell(r.duration_s) for r in reports]),
    ]
    for label, attr in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        for stat in ("mean", "p50", "p99"):
            rows.append((f"{label} {stat} ms", [_cell(getattr(getattr(r, attr), stat)) for r in reports]))
    rows += [
        ("output tokens/s", [_cell(r.output_tok_s) for r in reports]),
        ("requests/s", [_cell(r.request_throughput, 2) for r in reports]),
    ]
    if slo:
        rows.append(("goodput requests/s", [_cell(r.goodput, 2) for r in reports]))
    for label, cells in rows:
        table.add_row(label, *cells)
    return table


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("serve")
    def bench_serve(
        url: Annotated[str, typer.Option(help="Server base URL, e.g. http://127.0.0.1:8080 (a trailing /v1 is fine).")],
        concurrency: Annotated[str, typer.Option(help="Concurrency levels, comma-separated.")] = "1,8,32",
        num_prompts: Annotated[int, typer.Option(help="Requests per concurrency level.")] = 32,
        max_tokens: Annotated[int, typer.Option(help="max_tokens per request.")] = 128,
        dataset: Annotated[
            str, typer.Option(help="'builtin' or a JSONL file of {prompt} / {messages} rows.")] = "builtin",
        model: Annotated[Optional[str], typer.Option(help="Model id; default: the first of /v1/models.")] = None,
        api_key: Annotated[
            Optional[str], typer.Option(help="Bearer key; default: $MLC_API_KEY (its first key).")] = None,
        temperature: float = 0.0,
        ignore_eos: Annotated[bool, typer.Option(help="Ask for exactly max_tokens (vLLM/mlc extension).")] = False,
        slo_ttft_ms: Annotated[Optional[float], typer.Option(help="Goodput SLO on time to first token.")] = None,
        slo_tpot_ms: Annotated[Optional[float], typer.Option(help="Goodput SLO on time per output token.")] = None,
        timeout: Annotated[float, typer.Option(help="Seconds per request before it counts as failed.")] = 600.0,
        warmup: Annotated[int, typer.Option(help="Requests sent first and not measured.")] = 1,
        request_rate: Annotated[Optional[float], typer.Option(
            help="Requests/s arriving as a Poisson process (seeded); latencies count from arrival. Default: all at "
                 "once, as concurrency allows.")] = None,
        seed: Annotated[int, typer.Option(help="Seed of the prompt choice and of the arrival times.")] = 0,
        json_out: Annotated[Optional[Path], typer.Option("--json", help="Also write the results as JSON here.")] = None,
        plot: Annotated[Optional[Path], typer.Option(
            help="Write PNG plots with this path prefix: PREFIX-throughput.png, PREFIX-latency.png (TTFT and TPOT "
                 "p50/p99 against concurrency) and PREFIX-latency-cdf.png.")] = None,
        quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
        api: Annotated[str, typer.Option(
            help="The API the requests go to: chat (/v1/chat/completions), responses (/v1/responses) or messages "
                 "(Anthropic's /v1/messages); the same prompts, streamed.")] = "chat",
    ) -> None:
        """Measure TTFT, TPOT, ITL, E2E, throughput and goodput of a running OpenAI-compatible server."""
        from mlc.bench.serve import BenchConfig, run_bench, to_json

        if api not in ("chat", "responses", "messages"):
            raise InvalidRequestError(f"--api {api!r}: use chat, responses or messages", field="api")
        if ignore_eos and api != "chat":
            raise InvalidRequestError("--ignore-eos is a chat completions extension; use it with --api chat",
                                      field="ignore_eos")
        key = api_key or next(iter(k.strip() for k in os.environ.get("MLC_API_KEY", "").split(",") if k.strip()), None)
        cfg = BenchConfig(url=url, concurrency=parse_levels(concurrency), num_prompts=num_prompts,
                          max_tokens=max_tokens, dataset=dataset, model=model, api_key=key, temperature=temperature,
                          ignore_eos=ignore_eos,
                          slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, timeout_s=timeout, warmup=warmup,
                          request_rate=request_rate, seed=seed, api=api)
        if request_rate is not None and request_rate <= 0:
            raise InvalidRequestError(f"--request-rate {request_rate}: give a positive number of requests per second")

        from mlc.cli.progress import progress_bar

        with progress_bar(quiet) as bar:
            task = bar.add_task("bench serve: requests", total=len(cfg.concurrency) * num_prompts)

            def level_done(rep) -> None:
                console.print(f"concurrency {rep.concurrency}: {rep.completed} ok, {rep.failed} failed in "
                              f"{rep.duration_s:.1f}s", highlight=False)

            model_id, reports = asyncio.run(run_bench(cfg, on_level=level_done,
                                                      on_request=lambda _result: bar.advance(task)))
        console.print(serve_table(model_id, reports, slo_ttft_ms is not None or slo_tpot_ms is not None))
        for rep in reports:
            for e in rep.errors:
                console.print(f"[red]concurrency {rep.concurrency} error:[/] {escape(str(e))}", highlight=False)
        if json_out is not None:
            json_out.write_text(json.dumps(to_json(cfg, model_id, reports), indent=2) + "\n", encoding="utf-8")
            console.print(f"wrote {json_out}")
        if plot is not None:
            from mlc.bench.plots import cdf_plot, latency_plot, throughput_plot

            rate = f", {request_rate} req/s Poisson" if request_rate else ""
            paths = [
                throughput_plot({model_id: [(r.concurrency, r.output_tok_s) for r in reports]},
                                Path(f"{plot}-throughput.png"), f"bench serve: {model_id}{rate}"),
                latency_plot({f"{label} {stat}": [(r.concurrency, getattr(getattr(r, attr), stat)) for r in reports]
                              for label, attr in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms")) for stat in ("p50", "p99")},
                             Path(f"{plot}-latency.png"), f"latency against concurrency: {model_id}{rate}"),
                cdf_plot({f"concurrency {r.concurrency}": r.samples_ms["e2e"] for r in reports},
                         Path(f"{plot}-latency-cdf.png"), f"end-to-end latency: {model_id}{rate}", "E2E latency (ms)"),
            ]
            console.print("wrote " + ", ".join(map(str, paths)))
