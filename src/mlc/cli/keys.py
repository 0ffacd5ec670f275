"""`mlc-cli keys`: make API keys for `serve --api-key-file` (the file holds only their SHA-256 hashes)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from mlc.errors import ConfigError

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

Rpm = Annotated[Optional[int], typer.Option("--requests-per-minute", "--rpm", help="Requests a minute (rolling).")]
Tpm = Annotated[Optional[int], typer.Option("--tokens-per-minute", "--tpm",
                                            help="Prompt + completion tokens a minute (rolling).")]
Conc = Annotated[Optional[int], typer.Option("--max-concurrent", help="Requests in flight at once.")]


def append_entry(path: Path, entry: str) -> None:
    """Append a YAML list item to a key file (under its `keys:` when it has one); the file must still load."""
    from mlc.server.keys import load_key_file

    before = path.read_text(encoding="utf-8") if path.exists() else ""
    if before.strip() and not before.lstrip().startswith(("-", "keys:", "#")):
        raise ConfigError(f"{path}: only a YAML key file can be appended to; add this entry by hand:\n{entry}")
    def indent(text: str) -> str:
        return "".join("  " + line + "\n" for line in text.splitlines())

    if not before.strip():
        text = "keys:\n" + indent(entry)
    else:
        nested = any(line.startswith("keys:") for line in before.splitlines())
        text = before + ("" if before.endswith("\n") else "\n") + (indent(entry) if nested else entry)
    path.write_text(text, encoding="utf-8")
    try:
        load_key_file(path)
    except ConfigError:
        path.write_text(before, encoding="utf-8")
        raise


def register(app: typer.Typer) -> None:
    keys_app = typer.Typer(help="Make API keys for `serve --api-key-file`: named, stored as hashes, with limits.",
                           no_args_is_help=True)

    @keys_app.command("add")
    def add(
        name: Annotated[str, typer.Argument(help="The key's name (metrics, audit log): letters, digits, _.@-")],
        file: Annotated[Optional[Path], typer.Option(
            "--file", "-f", help="Append the entry to this key file (created if missing); else print it.")] = None,
        requests_per_minute: Rpm = None, tokens_per_minute: Tpm = None, max_concurrent: Conc = None,
    ) -> None:
        """Make a new random key: prints it once (keep it: only its hash is stored) and its key file entry."""
        from mlc.server.keys import entry_text, new_key

        key = new_key()
        entry = entry_text(name, key, requests_per_minute=requests_per_minute, tokens_per_minute=tokens_per_minute,
                           max_concurrent=max_concurrent)
        if file is not None:
            append_entry(file, entry)
            err.print(f"added key {name!r} to {file}; send SIGHUP to a running server to load it")
        else:
            out.print(entry, end="")
        err.print("the key (shown only now, give it to its user):")
        out.print(key)

    @keys_app.command("hash")
    def hash_(
        name: Annotated[str, typer.Argument(help="The key's name.")],
        key: Annotated[Optional[str], typer.Option(help="The key; default: read one line from stdin.")] = None,
        requests_per_minute: Rpm = None, tokens_per_minute: Tpm = None, max_concurrent: Conc = None,
    ) -> None:
        """Print the key file entry (name, key_sha256, limits) for an existing key."""
        from mlc.server.keys import entry_text

        given = key if key is not None else sys.stdin.readline().strip()
        if not given:
            raise ConfigError("no key given: pass --key KEY or write it on stdin")
        out.print(entry_text(name, given, requests_per_minute=requests_per_minute,
                             tokens_per_minute=tokens_per_minute, max_concurrent=max_concurrent), end="")

    app.add_typer(keys_app, name="keys")
