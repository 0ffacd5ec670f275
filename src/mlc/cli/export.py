"""`mlc-cli export`: a trained adapter as a merged HF checkpoint, or as a PEFT adapter dir."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

console = Console()


def export_cmd(
    adapter: Path = typer.Option(..., "--adapter", help="PEFT adapter dir (a run's adapter/ or a checkpoint)."),
    out: Path = typer.Option(..., "--out", "-o", help="Output dir."),
    merge: bool = typer.Option(False, "--merge", help="Merge into the base weights: a full HF checkpoint."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Base model (default: the adapter's own)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Merged weights dtype (default: the base's)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace --out if it exists."),
) -> None:
    """Write the merged checkpoint (config.json + safetensors + tokenizer) or a copy of the adapter."""
    from mlc.cli.progress import progress_bar
    from mlc.train.export import export_adapter

    with progress_bar(quiet=not merge) as bar:  # a copy of the adapter is instant
        task = bar.add_task("merging", total=4)

        def step(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=f"export --merge: {what}")

        path = export_adapter(adapter, out, merge=merge, model=model, dtype=dtype, overwrite=overwrite,
                              progress=step)
    kind = "merged checkpoint" if merge else "PEFT adapter"
    console.print(f"wrote {kind} to {path}", highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("export")(export_cmd)
