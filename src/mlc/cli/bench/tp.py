"""`mlc-cli bench tp`: offline throughput and batch-1 decode at tensor-parallel sizes 1, 2, ... in one run."""

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
    @bench_app.command("tp")
    @engine_options(exclude=("tensor_parallel_size",))  # --sizes gives it
    def tp(
        sizes: Annotated[str, typer.Option("--sizes", help="Tensor-parallel sizes, comma-separated; the first is "
                                           "the baseline.")] = "1,2",
        num_prompts: Annotated[int, typer.Option("--num-prompts")] = 32,
        max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 64,
        json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the report as JSON.")] = None,
        *,
        engine: EngineArgs,
    ) -> None:
        """The same greedy chat workload at each tensor-parallel size: throughput, batch-1 decode, ratios to the
        first size, and whether the greedy tokens stay the same."""
        from mlc.bench.tensor_parallel import run_tp
        from mlc.errors import ConfigError

        try:
            wanted = [int(s) for s in sizes.split(",") if s.strip()]
        except ValueError:
            raise ConfigError(f"--sizes {sizes!r}: give tensor-parallel sizes like 1,2") from None
        cfg = engine.resolve()
        with console.status(f"running sizes {wanted}"):
            report = run_tp(cfg, wanted, num_prompts, max_new_tokens)
        t = Table(title=f"bench tp: {report.model}, {num_prompts} chat prompts x {max_new_tokens} new tokens, "
                        f"greedy; weights {report.rows[0].weights}")
        for col in ("TP", "throughput tok/s", "ratio", "batch-1 decode tok/s", "ratio", "TTFT ms",
                    "greedy = TP 1"):
            t.add_column(col, justify="right")
        for row in report.rows:
            ratio_t, ratio_d = report.ratio(row, "throughput_tok_s"), report.ratio(row, "decode_tok_s")
            t.add_row(str(row.size), f"{row.throughput_tok_s:.1f}", f"{ratio_t:.2f}x" if ratio_t else "-",
                      f"{row.decode_tok_s:.1f}", f"{ratio_d:.2f}x" if ratio_d else "-",
                      f"{(row.ttft_s or 0) * 1e3:.0f}",
                      "-" if row.greedy_equal_to_tp1 is None else f"{row.greedy_equal_to_tp1:.0%}")
        console.print(t)
        if json_out:
            json_out.write_text(json.dumps(report.to_json(), indent=2))
            console.print(f"wrote {json_out}")
