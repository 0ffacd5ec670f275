"""`mlc-cli bench pp`: stage utilization of pipeline parallelism with a batch queue of depth 1 and of depth =
stages, against one process, on the same greedy chat batch."""

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
    @bench_app.command("pp")
    @engine_options(exclude=("pipeline_parallel_size", "pipeline_depth"))  # --stages gives them
    def pp(
        stages: Annotated[int, typer.Option("--stages", help="Pipeline stages.")] = 2,
        num_prompts: Annotated[int, typer.Option("--num-prompts")] = 16,
        max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 32,
        json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the report as JSON.")] = None,
        *,
        engine: EngineArgs,
    ) -> None:
        """The same greedy chat batch on one process, then on --stages stages at batch-queue depth 1 and depth =
        stages: wall time, throughput, and each stage's busy time over the wall time."""
        from mlc.bench.pipeline import run_pp

        cfg = engine.resolve()
        with console.status(f"running 1 process, then {stages} stages at depth 1 and {stages}"):
            report = run_pp(cfg, stages, num_prompts, max_new_tokens)
        t = Table(title=f"bench pp: {report.model}, {num_prompts} chat prompts x {max_new_tokens} new tokens, greedy")
        for col in ("run", "wall s", "tok/s", *(f"stage {i} busy" for i in range(stages)), "greedy = 1 process"):
            t.add_column(col, justify="right")
        for row in report.rows:
            used = [f"{u:.0%}" for u in row.utilization] if row.stages > 1 else ["-"] * stages
            t.add_row(row.label, f"{row.seconds:.2f}", f"{row.tok_s:.1f}", *used,
                      "-" if row.greedy_equal is None else ("yes" if row.greedy_equal else "NO"))
        console.print(t)
        if json_out:
            json_out.write_text(json.dumps(report.to_json(), indent=2))
            console.print(f"wrote {json_out}")
