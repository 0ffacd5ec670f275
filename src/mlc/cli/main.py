"""`mlc-cli` (alias `mlc`): one app; each command group lives in its own module with a `register(app)`."""

from __future__ import annotations

import importlib
import os
import sys

import typer
from rich.console import Console
from rich.markup import escape  # messages quote config syntax such as [cmd, arg], which is not markup

from mlc.errors import MlcError

# Command modules, in the order their commands appear in --help.
COMMAND_MODULES = [
    "models", "generate", "chat", "serve", "lora", "keys", "bench",
    "preprocess", "train", "evaluate", "export",
    "plan", "doctor", "compile", "config_cmd",
    "deploy", "launcher", "pd",
]

app = typer.Typer(
    name="mlc-cli",
    help="Serve, fine-tune, plan and benchmark GLM-family and Llama-style models.",
    pretty_exceptions_enable=False,
    add_completion=False,
)
err_console = Console(stderr=True)


def _register_all() -> None:
    for name in COMMAND_MODULES:
        importlib.import_module(f"mlc.cli.{name}").register(app)


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context, version: bool = typer.Option(False, "--version", help="Print the version and exit.")
) -> None:
    if version:
        from mlc import __version__

        typer.echo(f"mlc {__version__}")
        raise typer.Exit()
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())
        raise typer.Exit()


def _translated(argv: list[str]) -> list[str]:
    """Other tools' flags in our spellings (mlc/cli/compat.py), with a note on stderr for each one translated."""
    from mlc.cli.compat import translate_argv

    result = translate_argv(typer.main.get_command(app), argv)
    for note in result.notes:
        err_console.print(f"[cyan]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
    return result.argv


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _register_all()
    try:
        args = _translated(sys.argv[1:] if argv is None else argv)
        app(args=args, prog_name="mlc-cli")
    except MlcError as e:
        err_console.print(f"[bold red]error:[/] {escape(e.message)}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except ModuleNotFoundError as e:
        from mlc.cli.extras import missing_extra_message

        message = missing_extra_message(e)
        if message is None:
            raise
        err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
        sys.exit(MlcError.exit_code)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
