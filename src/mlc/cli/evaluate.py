"""`mlc-cli eval`: held-out loss and perplexity of a model, with or without a LoRA adapter."""

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
    data: Path = typer.Option(..., "--data", help="JSONL (any format `preprocess` reads) or a preprocess output dir."),
    adapter: Optional[Path] = typer.Option(None, "--adapter", help="PEFT LoRA adapter dir to apply."),
    max_seq_len: int = typer.Option(512, "--max-seq-len", help="As in training; longer rows are truncated."),
    batch_size: int = typer.Option(8, "--batch-size"),
    fmt: str = typer.Option("auto", "--format", help="auto, instruction, alpaca or chat."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda, npu or auto."),
    precision: str = typer.Option("auto", "--precision", help="auto (fp32 on CPU), fp32, bf16 or fp16."),
    samples: int = typer.Option(0, "--samples", help="Also print greedy answers to the first N prompts."),
    max_new_tokens: int = typer.Option(160, "--max-new-tokens", help="Length limit of each sample answer."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Token-level loss over the answer tokens (prompt masked, as in training) and its perplexity."""
    from mlc.train.evaluate import evaluate

    result = evaluate(
        model, data, adapter, max_seq_len=max_seq_len, batch_size=batch_size, fmt=fmt, device=device,
        precision=precision, samples=samples, max_new_tokens=max_new_tokens,
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


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_cmd)
