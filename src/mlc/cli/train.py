"""`mlc-cli train`: LoRA fine-tuning from a YAML config (+ key=value overrides); `mlc-cli train plot DIR`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

console = Console()


def _steps(text: str | None) -> frozenset[int]:
    from mlc.errors import ConfigError

    try:
        return frozenset(int(s) for s in text.split(",") if s.strip()) if text else frozenset()
    except ValueError:
        raise ConfigError(f"--inject-nonfinite-steps {text!r}: write step numbers like 3,4") from None


def _plot(args: list[str], smoothing: float | None) -> None:
    from mlc.errors import ConfigError
    from mlc.train.plot import plot_loss

    if len(args) != 1:
        raise ConfigError("usage: mlc-cli train plot RUN_DIR")
    console.print(f"wrote {plot_loss(args[0], weight=smoothing)}", highlight=False)


def _report(result) -> None:
    table = Table(title=f"LoRA run: {result.output_dir}", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")

    def fmt(x):
        return "-" if x is None else f"{x:.4f}"

    table.add_row("steps", f"{result.steps} ({result.skipped_steps} skipped)")
    if result.resumed_from is not None:
        table.add_row("resumed from", f"step {result.resumed_from}")
    table.add_row("train loss (last step)", fmt(result.train_loss))
    table.add_row("eval loss before -> after", f"{fmt(result.eval_loss_before)} -> {fmt(result.eval_loss_after)}")
    table.add_row("throughput", f"{result.tokens_per_s:.0f} tokens/s over {result.train_seconds:.1f} s of steps")
    table.add_row("peak RSS", f"{result.peak_rss_mb:.0f} MiB (rank 0)")
    table.add_row("adapter", result.adapter_dir)
    table.add_row("log / plot", f"{result.output_dir}/train_log.jsonl, {result.output_dir}/loss.png")
    console.print(table)


def split_config_arg(args: list[str], config: Path | None) -> tuple[list[str], Path | None]:
    """`mlc-cli train lora.yaml key=value` (LLaMA-Factory's habit): a first argument ending in .yaml/.yml is the
    config file."""
    from mlc.errors import ConfigError

    if not args or "=" in args[0] or not args[0].endswith((".yaml", ".yml")):
        return args, config
    if config is not None and Path(args[0]) != config:
        raise ConfigError(f"two configs given ({args[0]} and --config {config}); give one")
    return args[1:], Path(args[0])


def train_cmd(
    args: Optional[list[str]] = typer.Argument(
        None, help="[CONFIG.yaml] then config overrides as key=value (optimizer.lr=1e-4 max_steps=20), "
        "or `plot RUN_DIR`."
    ),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML training config (see configs/)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the latest checkpoint (must exist)."),
    fresh: bool = typer.Option(False, "--fresh", help="Delete output_dir's checkpoints and log, start over."),
    nproc: Optional[int] = typer.Option(
        None, "--nproc", min=1, help="Data-parallel processes (torchrun; gloo on CPU). Default: the config's nproc "
        "(parallel_config.data_parallel), else 1."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or per-step lines."),
    smoothing: Optional[float] = typer.Option(
        None, "--smoothing", help="`train plot`: EMA weight of the smoothed curve (default: by run length)."
    ),
    inject_nonfinite_steps: Optional[str] = typer.Option(
        None, hidden=True, help="Testing: make these steps' loss inf."),
    ui: bool = typer.Option(False, "--ui", help="Show the live loss curve, lr, grad norm, ETA and checkpoints in a "
                            "browser page on 127.0.0.1 (port --ui-port) while training."),
    ui_port: int = typer.Option(8090, "--ui-port", min=0, max=65535, help="Port of the --ui page (0: any free port)."),
    cluster_config: Optional[Path] = typer.Option(
        None, "--cluster-config", help="Run on the cluster's training pool with Ray Train (DDP workers, checkpoints "
        "on its training.storage, restarts after a worker dies)."),
    pull: bool = typer.Option(False, "--pull", help="Pull the config's model first when it is a hub id "
                              "(ORG/NAME[@REVISION], a GLM short name) that is not on this machine; without it such a "
                              "model is never downloaded."),
) -> None:
    """Fine-tune a LoRA adapter. Resumes automatically when output_dir has a checkpoint (`--fresh` to restart).

    Also reads the tutorial's lora YAML (lora_config, parallel_config) and LLaMA-Factory's keys, and MindFormers'
    run_mindformer.py flags (--run_mode, --device_target, --data_url, --ckpt_url, --output_dir)."""
    args = list(args or [])
    if args and args[0] == "plot":
        return _plot(args[1:], smoothing)
    from mlc.cli.common import print_notes
    from mlc.config.ascend_env import apply_train_env
    from mlc.config.loader import load_train_config
    from mlc.errors import ConfigError
    from mlc.train.distributed import launch, launched_by_torchrun

    if resume and fresh:
        raise ConfigError("--resume and --fresh contradict each other; pick one")
    args, config = split_config_arg(args, config)
    notes: list[str] = []
    cfg = load_train_config(config, args, notes)  # validate before spawning workers
    # the tutorial's BATCH_SIZE, SEQ_LEN, RANK_SIZE, ...
    cfg, env_notes = apply_train_env(cfg, os.environ, nproc, not launched_by_torchrun())
    notes += env_notes
    if not launched_by_torchrun():
        print_notes(notes)
        from mlc.cli.pulling import pull_if_asked

        pull_if_asked(cfg.model, pull)
        if ui:
            from mlc.train.ui import start_ui

            start_ui(cfg.output_dir, ui_port)
    if cluster_config is not None:
        from mlc.cli.deploy import train_on_cluster_cmd

        if cfg.tensor_parallel > 1:
            raise ConfigError(f"tensor_parallel {cfg.tensor_parallel} (model_parallel) is not run on a Ray cluster "
                              "yet: Ray Train workers each hold a whole model. Set it to 1 there, or run "
                              "`mlc-cli train` on one node, which starts the split processes itself")

        return train_on_cluster_cmd(cluster_config, config, args, cfg, resume, fresh)
    nproc = (nproc or cfg.nproc) * cfg.tensor_parallel  # data-parallel copies x the ranks of each copy
    if cfg.tensor_parallel > 1 and not launched_by_torchrun():  # a model that cannot be split: say so before
        from mlc.models.hf_checkpoint import read_config  # any process starts
        from mlc.models.store import resolve_model_dir
        from mlc.train.tensor_parallel import check_trainable

        check_trainable(read_config(resolve_model_dir(cfg.model)), cfg.tensor_parallel)
    if nproc > 1 and not launched_by_torchrun():
        worker_args = ["train", *(["--config", str(config)] if config else []), *args]
        worker_args += [flag for flag, on in (("--resume", resume), ("--fresh", fresh), ("--quiet", quiet)) if on]
        if inject_nonfinite_steps:
            worker_args += ["--inject-nonfinite-steps", inject_nonfinite_steps]
        return launch(nproc, worker_args)
    from mlc.train.run import RunOptions, train

    opts = RunOptions(
        resume="always" if resume else "auto", fresh=fresh, progress=not quiet,
        inject_nonfinite_steps=_steps(inject_nonfinite_steps),
    )
    result = train(cfg, opts)
    if _is_rank0():
        _report(result)


def _is_rank0() -> bool:
    import os

    return os.environ.get("RANK", "0") == "0"


def register(app: typer.Typer) -> None:
    app.command("train", context_settings={"help_option_names": ["-h", "--help"]})(train_cmd)
