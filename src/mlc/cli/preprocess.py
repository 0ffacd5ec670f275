"""`mlc-cli preprocess`: instruction JSONL -> tokenized Arrow dataset + stats.json."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

console = Console()


def preprocess_cmd(
    input_file: Path = typer.Argument(..., help=(
        "JSONL (or a JSON array): {instruction, output}, alpaca, {messages: [...]} or ShareGPT "
        "{conversations: [{from, value}]} rows; a dataset_info.json entry naming the file renames their keys.")),
    out: Path = typer.Option(..., "--out", "-o", help="Output dir (Arrow dataset + stats.json)."),
    model: str = typer.Option("smollm2-135m-instruct", "--model", "-m", help=(
        "Whose tokenizer and chat template: a store name, a checkpoint dir, an org/name in the HF cache, or a "
        "tokenizer-only dir.")),
    fmt: str = typer.Option("auto", "--format", help="auto, instruction, alpaca, chat or sharegpt."),
    max_seq_len: int = typer.Option(512, "--max-seq-len", "--seq-len", help="Longer rows are truncated (and counted)."),
    pad_to_multiple_of: int = typer.Option(16, "--pad-to-multiple-of", help="Row lengths are padded to this."),
    train_on_prompt: bool = typer.Option(False, "--train-on-prompt", help="Keep prompt tokens in the labels."),
    packing: bool = typer.Option(False, "--packing", help="Pack several rows into each max_seq_len sequence."),
    on_error: str = typer.Option("skip", "--on-error", help="skip: drop bad rows and report them; fail: stop."),
) -> None:
    """Tokenize with the model's chat template, mask prompt tokens, truncate, pad; report what was dropped.

    The tutorial's preprocess.py flags work too: --input_file, --output_file (-> --out), --tokenizer_path
    (-> --model), --max_seq_len, --pad_to_multiple_of."""
    from mlc.cli.progress import progress_bar
    from mlc.models.store import resolve_tokenizer_dir
    from mlc.models.tokenizer import load_tokenizer
    from mlc.train.preprocess import PreprocessOptions, preprocess_file

    opts = PreprocessOptions(
        max_seq_len=max_seq_len, pad_to_multiple_of=pad_to_multiple_of, train_on_prompt=train_on_prompt,
        packing=packing, format=fmt, on_error=on_error,
    )
    tokenizer = load_tokenizer(resolve_tokenizer_dir(model))
    with progress_bar(counts=False) as bar:
        task = bar.add_task(f"tokenizing {input_file.name}", total=None)

        def advance(rows: int, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, description=f"tokenizing {input_file.name}: {rows} rows")

        stats = preprocess_file(input_file, out, tokenizer, opts, model=model, progress=advance)
    console.print(
        f"{stats.rows} rows -> {stats.sequences} sequences, {stats.tokens} tokens "
        f"({stats.trainable_tokens} trained on, {stats.padded_tokens} with padding), "
        f"{stats.truncated} truncated, {len(stats.dropped)} dropped -> {out}",
        highlight=False, soft_wrap=True,
    )
    if stats.dataset_info:
        console.print(f"  keys read as {stats.dataset_info} names them (formatting, columns, tags)",
                      highlight=False, soft_wrap=True)
    for d in stats.dropped[:10]:
        where = f"{input_file} row {d['line']}" if stats.layout == "json" else f"{input_file}:{d['line']}"
        console.print(f"[yellow]  dropped {where}: {d['reason']}[/]", highlight=False, soft_wrap=True)
    if len(stats.dropped) > 10:
        console.print(f"  ... and {len(stats.dropped) - 10} more, all listed in {out / 'stats.json'}")


def register(app: typer.Typer) -> None:
    app.command("preprocess")(preprocess_cmd)
