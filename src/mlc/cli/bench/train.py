"""`mlc-cli bench train`: LoRA SFT, our trainer against transformers' Trainer + PEFT on the same config (issue 32)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

console = Console()


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("train")
    def train(
        model: Annotated[str, typer.Option(help="Model name or path.")] = "smollm2-135m-instruct",
        data: Annotated[str, typer.Option(help="Training rows (JSONL).")] = "data/customer_service.jsonl",
        steps: Annotated[int, typer.Option(help="Optimizer steps on each side (2 or more).")] = 50,
        rounds: Annotated[int, typer.Option(help="Runs of each side, alternating which goes first.")] = 1,
        set_: Annotated[Optional[list[str]], typer.Option(
            "--set", help="A training config key on top of its defaults, repeatable: --set batch_size=8 "
                          "--set data.packing=true --set precision=fp32.")] = None,
        out: Annotated[Optional[Path], typer.Option(
            "--out", help="Directory for train.json, train.png and each side's run "
                          "(default: bench-train-<time>).")] = None,
    ) -> None:
        """Tokens/s, peak RSS and the loss curve of a LoRA SFT run with our trainer and with transformers' Trainer +
        PEFT, from the same model, adapter init, batches, optimizer, schedule and precision (LoRA dropout 0).
        Goals: >= 1.5x tokens/s, <= 0.6x peak RSS, every step's loss within 1e-3. Exits 1 when a goal is missed."""
        from mlc.bench.train_compare import TrainBenchConfig, plot, run_train_bench
        from mlc.config.dotted import parse_assignments
        from mlc.errors import InvalidRequestError

        if steps < 2 or rounds < 1:
            raise InvalidRequestError("--steps must be at least 2 (the first step's one-off costs are left out of "
                                      "tokens/s) and --rounds at least 1")
        if not Path(data).is_file():
            raise InvalidRequestError(f"--data {data}: no such file; run from the repository root (the default is "
                                      "its data/customer_service.jsonl) or give --data PATH")
        data = str(Path(data).resolve())
        out_dir = out or Path(time.strftime("bench-train-%Y%m%d-%H%M%S"))
        cfg = TrainBenchConfig(out_dir=out_dir, model=model, data=data, steps=steps, rounds=rounds,
                               overrides=parse_assignments(set_, "--set", "--set batch_size=8"))
        result = run_train_bench(cfg, progress=lambda msg: console.print(msg, highlight=False))
        (out_dir / "train.json").write_text(json.dumps(result, indent=1) + "\n")
        plot(result, out_dir / "train.png")
        m, h = result["per_round"]["mlc"][0], result["per_round"]["hf"][0]
        diff = result["max_loss_diff"] if result["max_loss_diff"] is not None else float("nan")
        console.print(f"mlc {m['tokens_per_s']:.0f} tokens/s, peak RSS {m['process_peak_mib']:.0f} MiB; transformers "
                      f"Trainer + PEFT {h['tokens_per_s']:.0f} tokens/s, {h['process_peak_mib']:.0f} MiB: "
                      f"{result['speed_ratio']:.2f}x tokens/s, {result['peak_rss_ratio']:.2f}x peak RSS, loss "
                      f"differs by at most {diff:.2e} over {result['steps_compared']} steps",
                      highlight=False)
        for goal, met in result["goals"].items():
            console.print(f"  {goal}: {'met' if met else 'NOT met'}", highlight=False)
        console.print(f"wrote {out_dir}/train.json, {out_dir}/train.png")
        if not all(result["goals"].values()):
            raise typer.Exit(1)
