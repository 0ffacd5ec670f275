"""`mlc-cli models list | pull | verify | info`: the model store."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

console = Console()
models_app = typer.Typer(
    help="List, pull, verify and describe models in the store ($MLC_HOME/models).", no_args_is_help=True)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _short(revision: str | None) -> str:
    """`pkg==1.0+sha256:<64 hex>` -> `pkg==1.0+sha256:<12 hex>` for tables; `info` shows it whole."""
    if not revision:
        return "-"
    head, sep, digest = revision.partition("sha256:")
    return f"{head}{sep}{digest[:12]}" if sep else revision


@models_app.command("list")
def list_cmd() -> None:
    """Known and pulled models."""
    from mlc.config.paths import models_dir
    from mlc.models.store.listing import list_models

    table = Table(title=f"models in {models_dir()}")
    for col in ("name", "status", "size", "revision", "description"):
        table.add_column(col, overflow="fold")
    for e in list_models():
        status = "[green]pulled[/]" if e.pulled else "[dim]not pulled[/]"
        table.add_row(e.name, status, _size(e.size_bytes) if e.pulled else "-", _short(e.revision), e.description)
    console.print(table)


@models_app.command("pull")
def pull_cmd(
    name: str = typer.Argument(..., help="A known model name (see `models list`) or a .gguf file."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print one line, no progress bar."),
    force: bool = typer.Option(False, "--force", help="Convert again even if the model is in the store."),
) -> None:
    """Install and convert a model into the store (a no-op when it is already there)."""
    from mlc.models.store.pulling import pull

    if quiet:
        result = pull(name, force=force)
    else:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task(f"converting {name}", total=None)

            def progress(done: int, total: int, tensor: str) -> None:
                bar.update(task, completed=done, total=total, description=f"dequantizing {tensor}")

            result = pull(name, progress=progress, force=force)
    state = f"converted in {result.seconds:.1f} s" if result.converted else "already in the store"
    console.print(f"{result.name}: {state} at {result.path}", highlight=False, soft_wrap=True)


@models_app.command("verify")
def verify_cmd(name: str = typer.Argument(..., help="A model in the store.")) -> None:
    """Recompute every file's sha256 against the manifest; fails naming the file that differs."""
    from mlc.models.store.verifying import verify

    files = verify(name)
    table = Table(title=f"{name}: all {len(files)} files match the manifest")
    for col in ("file", "size", "sha256"):
        table.add_column(col)
    for rel, rec in files.items():
        table.add_row(rel, _size(int(rec["size"])), rec["sha256"][:16] + "…")
    console.print(table)


@models_app.command("info")
def info_cmd(name: str = typer.Argument(..., help="A model in the store.")) -> None:
    """Source, revision, conversion date and architecture of a pulled model."""
    from mlc.models.store.listing import info

    data = info(name)
    table = Table(title=name, show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value", overflow="fold")
    table.add_row("path", data["path"])
    table.add_row("revision", str(data.get("revision")))
    table.add_row("source", ", ".join(f"{k}={v}" for k, v in data.get("source", {}).items()))
    table.add_row("converted at", str(data.get("converted_at")))
    table.add_row("converter", ", ".join(f"{k} {v}" for k, v in data.get("converter", {}).items()))
    for key, value in data["config"].items():
        table.add_row(key, str(value))
    total = sum(int(r["size"]) for r in data.get("files", {}).values())
    table.add_row("files", f"{len(data.get('files', {}))} ({_size(total)})")
    console.print(table)


def register(app: typer.Typer) -> None:
    app.add_typer(models_app, name="models")
