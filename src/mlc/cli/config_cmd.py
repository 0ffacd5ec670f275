"""`mlc-cli config init serve|lora|cluster` writes a commented template; `mlc-cli config check FILE` validates
and lints."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from mlc.config.loader import CONFIG_KINDS, load_any, parse_set_options
from mlc.errors import ConfigError

TEMPLATES = Path(__file__).resolve().parents[1] / "config" / "templates"
config_app = typer.Typer(help="Write and check serve, lora and cluster config files.", no_args_is_help=True)
console = Console(soft_wrap=True)


def template_path(kind: str) -> Path:
    if kind not in CONFIG_KINDS:
        raise ConfigError(f"unknown config kind {kind!r} (allowed: {', '.join(CONFIG_KINDS)})")
    path = TEMPLATES / f"{kind}.yaml"
    if not path.is_file():
        raise ConfigError(f"no {kind} template in this install ({path}); write the file by hand or update mlc")
    return path


@config_app.command("init")
def init(
    kind: str = typer.Argument(..., help="serve | lora | cluster"),
    out: str = typer.Option(None, "--out", "-o", help="Where to write it (default ./KIND.yaml; '-' for stdout)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
) -> None:
    """Write a commented template config."""
    text = template_path(kind).read_text(encoding="utf-8")
    if out == "-":
        typer.echo(text, nl=False)
        return
    dest = Path(out or f"{kind}.yaml")
    if dest.exists() and not force:
        raise ConfigError(f"{dest} exists; pass --force to overwrite it or --out another path")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text, encoding="utf-8")
    console.print(f"wrote {dest}; check it with `mlc-cli config check {dest}`", highlight=False)


@config_app.command("check")
def check(
    file: Path = typer.Argument(..., help="A serve, lora or cluster YAML file."),
    kind: str = typer.Option(None, "--kind", help="serve | lora | cluster (default: guessed from the keys)."),
    hardware: str = typer.Option(
        None, "--hardware", help="Profile to lint against (default: from the config's device)."),
    set_: list[str] = typer.Option(
        None, "--set", help="Override a key before checking, e.g. --set engine.page_size=32."),
    as_json: bool = typer.Option(False, "--json", help="Print the findings as JSON."),
) -> None:
    """Validate a config against its schema, then lint it against a hardware profile. Exit 1 on lint errors."""
    from mlc.config.hardware import load_profile
    from mlc.config.lint import default_profile, has_errors, lint

    kind, config = load_any(file, kind, assignments=parse_set_options(set_))
    if kind == "serve":
        check_stages(config.engine)  # type: ignore[attr-defined]
    profile = load_profile(hardware) if hardware else default_profile(config)
    findings = lint(config, profile)
    if as_json:
        typer.echo(json.dumps({"file": str(file), "kind": kind, "profile": profile.name,
                               "findings": [f.__dict__ for f in findings]}, indent=2))
    else:
        print_findings(console, findings, f"{file}: valid {kind} config; lint against {profile.name}")
    if has_errors(findings):
        raise typer.Exit(1)


def check_stages(engine) -> None:
    """Pipeline stages against the model's layers (and their tensor-parallel ranks against its heads), when the model
    is on this machine (config.json only)."""
    if engine.pipeline_parallel_size <= 1:
        return
    from mlc.engine.pp_stage import stage_ranges
    from mlc.models.hf_checkpoint import read_config
    from mlc.models.store import resolve_model_dir

    try:
        cfg = read_config(resolve_model_dir(engine.model))
    except Exception:
        return  # not pulled here: the engine checks at start
    stage_ranges(cfg, engine.pipeline_parallel_size)  # raises ConfigError with what to set
    from mlc.distributed.checks import check_shardable

    check_shardable(cfg, engine.tensor_parallel_size, engine.enable_expert_parallel)


def print_findings(out: Console, findings, title: str) -> None:
    """One finding per block: severity, rule and message, then why and the fix."""
    out.print(title + (": no findings" if not findings else ""), highlight=False)
    colors = {"error": "red", "warning": "yellow", "info": "cyan"}
    for f in findings:
        out.print(f"[{colors[f.severity]}]{f.severity:7}[/] {f.rule}: {escape(f.message)}", highlight=False)
        out.print(f"        why: {escape(f.reason)}", highlight=False)
        out.print(f"        fix: {escape(f.fix)}", highlight=False)


def register(app: typer.Typer) -> None:
    app.add_typer(config_app, name="config")
