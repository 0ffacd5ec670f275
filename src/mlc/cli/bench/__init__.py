"""`mlc-cli bench ...`: the benchmark group. `bench serve` loads a running server over HTTP; the others run the
engine in-process and compare it with its peers. Each command's module has `register(bench_app)`."""

from __future__ import annotations

import importlib

import typer

# in the order --help lists them
COMMANDS = ["serve", "offline", "kv", "quant", "compare", "scale", "soak", "fairness", "spec", "tp", "pp", "pd",
            "lora", "train"]


def register(app: typer.Typer) -> None:
    bench_app = typer.Typer(help="Benchmarks. `bench serve` loads a running OpenAI-compatible server over HTTP.",
                            no_args_is_help=True)
    for name in COMMANDS:
        importlib.import_module(f"mlc.cli.bench.{name}").register(bench_app)
    app.add_typer(bench_app, name="bench")
