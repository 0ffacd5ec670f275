"""`mlc-cli bench offline`: engine throughput and batch-1 decode against transformers, in one run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from mlc.cli.engine_options import EngineArgs, engine_options

console = Console()


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def report_table(r) -> Table:
    t = Table(title=f"bench offline: {r.model}, {r.num_prompts} chat prompts x {r.max_new_tokens} new tokens, greedy; "
                    f"mlc weights {r.weights}, max_batch_size {r.max_batch_size}; transformers fp32")
    for col in ("", "mlc", "transformers", "ratio"):
        t.add_column(col, justify="right" if col else "left")
    pb, ps = r.peer_batch, r.peer_single
    t.add_row(f"throughput tok/s (transformers batches of {r.peer_batch_size})",
              _fmt(r.ours_batch.tok_s), _fmt(pb.tok_s if pb else None), _fmt(r.ratio("batch"), 2) + "x")
    t.add_row("batch-1 decode tok/s", _fmt(r.ours_single.tok_s), _fmt(ps.tok_s if ps else None),
              _fmt(r.ratio("single"), 2) + "x")
    t.add_row("wall time s (all prompts)", _fmt(r.ours_batch.seconds), _fmt(pb.seconds if pb else None), "")
    t.add_row("batch-1 TTFT ms", _fmt((r.ours_single.ttft_s or 0) * 1e3),
              _fmt((ps.ttft_s or 0) * 1e3 if ps else None), "")
    t.add_row("peak RSS MiB (mlc phase)", _fmt(r.ours_peak_rss_mib, 0), "", "")
    if r.outputs_agree is not None:
        t.add_row("greedy tokens equal to transformers fp32 (5 prompts x 32)", f"{r.outputs_agree:.0%}", "", "")
    return t


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("offline")
    @engine_options()
    def offline(
        num_prompts: Annotated[int, typer.Option("--num-prompts")] = 32,
        max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 128,
        peer_batch_size: Annotated[int, typer.Option("--peer-batch-size", help="transformers' static batch.")] = 8,
        no_peer: Annotated[bool, typer.Option("--no-peer", help="Skip transformers.")] = False,
        json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the report as JSON.")] = None,
        *,
        engine: EngineArgs,
    ) -> None:
        """Our engine vs transformers generate on the same prompts, greedy, EOS ignored."""
        from mlc.bench.offline import run_offline

        cfg = engine.resolve()
        with console.status("running the engine, then transformers"):
            report = run_offline(cfg, num_prompts, max_new_tokens, peer_batch_size, not no_peer)
        console.print(report_table(report))
        if json_out:
            json_out.write_text(json.dumps(report.to_json(), indent=2))
            console.print(f"wrote {json_out}")
