"""`mlc-cli eval`: held-out loss and perplexity of a model, with or without a LoRA adapter; or, with --tasks,
lm-evaluation-harness tasks from local YAML files scored by the engine (`train/harness.py`)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

console = Console()


def eval_cmd(
    model: str = typer.Option("smollm2-135m-instruct", "--model", "-m", help="Store name or HF checkpoint dir."),
    data: Optional[Path] = typer.Option(None, "--data", help="JSONL (any format `preprocess` reads) or a preprocess "
                                        "output dir."),
    tasks: Optional[list[Path]] = typer.Option(None, "--tasks", help="lm-eval task YAML file or folder of them "
                                               "(repeatable): run those tasks in-process instead of --data."),
    limit: Optional[int] = typer.Option(None, "--limit", help="With --tasks: at most this many documents per task."),
    num_fewshot: Optional[int] = typer.Option(None, "--num-fewshot", help="With --tasks: few-shot examples."),
    adapter: Optional[Path] = typer.Option(None, "--adapter", help="PEFT LoRA adapter dir to apply."),
    max_seq_len: int = typer.Option(
        512, "--max-seq-len", "--seq-len", help="As in training; longer rows are truncated."),
    batch_size: int = typer.Option(8, "--batch-size"),
    fmt: str = typer.Option("auto", "--format", help="auto, instruction, alpaca or chat."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda, npu or auto."),
    precision: str = typer.Option("auto", "--precision", help="auto (fp32 on CPU), fp32, bf16 or fp16."),
    samples: int = typer.Option(0, "--samples", help="Also print greedy answers to the first N prompts."),
    max_new_tokens: int = typer.Option(160, "--max-new-tokens", help="Length limit of each sample answer."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Token-level loss over the answer tokens (prompt masked, as in training) and its perplexity; or lm-eval tasks
    (--tasks), scored exactly as `lm_eval --model local-completions` scores them through `mlc-cli serve`."""
    from mlc.errors import ConfigError

    if tasks:
        _run_tasks(model, tasks, limit, num_fewshot, batch_size, device, as_json)
        return
    if data is None:
        raise ConfigError("give --data FILE (loss and perplexity) or --tasks TASK.yaml (lm-eval tasks)")
    from mlc.cli.progress import progress_bar
    from mlc.train.evaluate import evaluate

    with progress_bar() as bar:
        task = bar.add_task(f"scoring {data.name}", total=None)
        result = evaluate(
            model, data, adapter, max_seq_len=max_seq_len, batch_size=batch_size, fmt=fmt, device=device,
            precision=precision, samples=samples, max_new_tokens=max_new_tokens,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    if as_json:
        typer.echo(json.dumps(asdict(result), ensure_ascii=False, indent=2))
        return
    which = f"{model} + {adapter}" if adapter else model
    console.print(
        f"{which} on {data}: loss {result.loss:.4f}, perplexity {result.perplexity:.2f} "
        f"({result.rows} rows, {result.target_tokens} answer tokens, {result.dropped} rows dropped)",
        highlight=False, soft_wrap=True,
    )
    for s in result.samples:
        console.print(f"[bold]Q:[/] {s['prompt']}\n[bold]A:[/] {s['answer']}\n", highlight=False, soft_wrap=True)


def _run_tasks(model: str, tasks: list[Path], limit: int | None, num_fewshot: int | None, batch_size: int,
               device: str, as_json: bool) -> None:
    from mlc.cli.progress import progress_bar
    from mlc.engine.llm import LLM
    from mlc.train.harness import run_tasks

    llm = LLM(model, device=device)
    results: dict = {"results": {}}
    with progress_bar() as bar:  # one step per task file or folder given; lm-eval shows its own bars within
        task = bar.add_task("lm-eval tasks", total=len(tasks))
        for path in tasks:
            bar.update(task, description=f"lm-eval {path.name}")
            results["results"].update(run_tasks(llm, [path], limit, num_fewshot, batch_size)["results"])
            bar.advance(task)
    scores = {task: {k: v for k, v in metrics.items() if k != "alias" and not k.endswith("_stderr,none")}
              for task, metrics in results["results"].items()}
    if as_json:
        typer.echo(json.dumps(scores, ensure_ascii=False, indent=2))
        return
    for task, metrics in scores.items():
        shown = ", ".join(f"{k.removesuffix(',none')} {v:.4f}" for k, v in metrics.items() if isinstance(v, float))
        console.print(f"{task}: {shown}", highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_cmd)
