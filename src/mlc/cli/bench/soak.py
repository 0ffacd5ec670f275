"""`mlc-cli bench soak`: hours of mixed traffic against one server, with the invariants that must hold."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markdown import Markdown

console = Console()


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("soak")
    def soak(
        duration: Annotated[float, typer.Option(help="Seconds of traffic.")] = 3600.0,
        url: Annotated[Optional[str], typer.Option(
            help="A running server to soak; default: start `mlc-cli serve` on its defaults (plus "
                 "--server-arg).")] = None,
        model: Annotated[Optional[str], typer.Option(
            help="The model to serve (or, with --url, to name in requests); default: the default model.")] = None,
        server_arg: Annotated[Optional[list[str]], typer.Option(
            "--server-arg", help="Extra flag for the started server, repeatable (e.g. --server-arg=--lora "
                                 "--server-arg=support=./adapter).")] = None,
        rate: Annotated[Optional[float], typer.Option(
            help="Requests/s (Poisson); default: --load x the saturation measured in a 60 s closed loop.")] = None,
        load: Annotated[float, typer.Option(help="Share of the measured saturation to run at.")] = 0.7,
        sample: Annotated[float, typer.Option(help="Seconds between samples of the server.")] = 5.0,
        warmup: Annotated[Optional[float], typer.Option(
            help="Seconds before the RSS and drift baselines (default: a tenth of the run, at most 300).")] = None,
        lora: Annotated[Optional[str], typer.Option(
            help="An adapter name the server serves, added to the mix.")] = None,
        max_rss_growth: Annotated[float, typer.Option(help="Allowed RSS growth after the warm-up.")] = 0.05,
        max_latency_drift: Annotated[float, typer.Option(
            help="Allowed rise of p99 TTFT and TPOT from the first window after warm-up to the last (a fifth of "
                 "the run, at most 10 minutes).")] = 0.2,
        idle_connections: Annotated[int, typer.Option(
            help="Connections held open without a request, beside the mix (each reopened when cut).")] = 0,
        slow_readers: Annotated[int, typer.Option(
            help="Clients that ask for a 256-token stream and read it a byte a second.")] = 0,
        crowd_after: Annotated[float, typer.Option(
            help="Seconds into the run at which the idle connections and slow readers join (0: from the start). "
                 "Later than the warm-up, the mix's p99 TTFT and TPOT before they join is the baseline they are "
                 "judged against (from a minute after they join).")] = 0.0,
        max_crowd_slowdown: Annotated[float, typer.Option(
            help="Allowed rise of the mix's p99 TTFT and TPOT beside the crowd (with --crowd-after).")] = 0.2,
        out: Annotated[Optional[Path], typer.Option(
            "--out", help="Directory for soak.json, soak.md, soak.png and the server log "
                          "(default: bench-soak-<time>).")] = None,
        seed: Annotated[int, typer.Option(help="Seed of the mix and the arrivals.")] = 0,
    ) -> None:
        """Send every kind of request the API serves (streaming or not, tools and tool_choice, json_schema, n=2,
        logprobs, echo, stop strings, shared prefixes, prompts near the context limit, an adapter with --lora) at a
        steady rate, with injected faults (clients dropping streams, client deadlines, malformed bodies), sampling
        RSS, KV pages, fds, threads, asyncio tasks and latency. Exits 1 when an invariant is violated."""
        from mlc.bench.soak import SoakConfig, run_soak
        from mlc.errors import InvalidRequestError

        if duration <= 0 or sample <= 0 or not 0 < load <= 1 or (rate is not None and rate <= 0) or \
                min(idle_connections, slow_readers) < 0 or not 0 <= crowd_after < duration:
            raise InvalidRequestError("--duration and --sample must be positive, --load in (0, 1], --rate above 0, "
                                      "--idle-connections and --slow-readers 0 or more, --crowd-after from 0 to "
                                      "less than --duration")
        if crowd_after > 0 and not (idle_connections or slow_readers):
            raise InvalidRequestError("--crowd-after needs a crowd: give --idle-connections N and/or --slow-readers M")
        out_dir = out or Path(time.strftime("bench-soak-%Y%m%d-%H%M%S"))
        cfg = SoakConfig(out_dir=out_dir, duration_s=duration, url=url.rstrip("/") if url else None, model=model,
                         server_args=list(server_arg or []), rate=rate, load=load, sample_s=sample, warmup_s=warmup,
                         lora=lora, max_rss_growth=max_rss_growth, max_latency_drift=max_latency_drift,
                         idle_connections=idle_connections, slow_readers=slow_readers, crowd_after_s=crowd_after,
                         max_crowd_slowdown=max_crowd_slowdown, seed=seed)
        if 0 < crowd_after <= cfg.warmup:
            raise InvalidRequestError(f"--crowd-after {crowd_after:g} falls in the warm-up ({cfg.warmup:g} s): the mix "
                                      "before the crowd is the baseline, so let it join after the warm-up (or at 0, "
                                      "from the start)")
        _, ok = run_soak(cfg, progress=lambda msg: console.print(msg, highlight=False))
        console.print(Markdown((out_dir / "soak.md").read_text()))
        console.print(f"wrote {out_dir}/soak.json, {out_dir}/soak.md, {out_dir}/soak.png")
        if not ok:
            raise typer.Exit(1)
