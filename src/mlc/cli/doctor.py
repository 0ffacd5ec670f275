"""`mlc-cli doctor`: check this host, the model store and optional files; exit 1 when something blocks."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

console = Console(soft_wrap=True)
MARKS = {"ok": "[green]ok[/]  ", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]", "skip": "[dim]skip[/]"}


def doctor_command(
    prompt_file: Path = typer.Option(None, "--prompts-file", "--prompt-file",
                                     help="Find invisible characters (U+200B, ...) in a prompt."),
    train_log: Path = typer.Option(
        None, "--train-log", help="A run dir or train_log.jsonl to scan for NaN/inf losses."),
    config: Path = typer.Option(None, "--config", help="A serve, lora or cluster YAML to validate and lint."),
    hardware: str = typer.Option(None, "--hardware", help="Profile to lint the config against."),
    port: int = typer.Option(None, "--port", help="Port the server will use (default: check 8080, as a warning)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface for the port check."),
    model: list[str] = typer.Option(None, "--model", help="Verify only these store models (default: all pulled)."),
    no_store: bool = typer.Option(False, "--no-store", help="Skip hashing the model store."),
    as_json: bool = typer.Option(False, "--json", help="Print the checks as JSON."),
) -> None:
    """Check the host, the model store, a port, and optionally a config, a prompt file and a training log."""
    from mlc.doctor.run import DoctorOptions, blocking, run_doctor

    opts = DoctorOptions(prompt_file, train_log, config, hardware, port, host, model or None, not no_store)
    checks = run_doctor(opts)
    if as_json:
        typer.echo(json.dumps([c.__dict__ for c in checks], indent=2, ensure_ascii=False))
    else:
        for c in checks:
            console.print(f"{MARKS[c.status]} {c.name}: {c.detail}", highlight=False)
            for item in c.items:
                console.print(f"       {item}", highlight=False)
            if c.fix and c.status in ("warn", "fail"):
                console.print(f"       fix: {c.fix}", highlight=False)
        fails = sum(c.status == "fail" for c in checks)
        console.print(f"{fails} blocking problem(s)" if fails else "nothing blocks", highlight=False)
    if blocking(checks):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor_command)
