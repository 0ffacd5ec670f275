"""The tutorial's launcher: `mlc-cli MODEL_ALIAS --mode inference|train|plan [--seq-len N] [--device-id K]`, e.g.
`mlc-cli glm5 --mode inference --seq-len 16384`. It resolves the preset, detects the hardware, takes the settings
`plan` recommends there, prints them, and runs `serve`, `train` or `plan` with them."""

from __future__ import annotations

from enum import Enum
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from mlc.cluster.presets import BATCH
from mlc.errors import ConfigError

console = Console(stderr=True, soft_wrap=True)


class Mode(str, Enum):
    inference = "inference"
    train = "train"
    plan = "plan"


def device_for(device: str, device_id: int | None) -> str:
    if device_id is None:
        return device
    if device == "cpu":
        if device_id != 0:
            raise ConfigError(f"--device-id {device_id}: this machine has no accelerator, only the CPU (device 0)")
        return "cpu"
    return f"{device}:{device_id}"


def model_arg(preset, path) -> str:
    """The store name when the store holds the preset (clients then see that name), else its directory."""
    from mlc.models.store.paths import is_pulled

    return preset.name if is_pulled(preset.name) else str(path)


def command_for(mode: Mode, preset, settings, model_dir: str | None, device: str) -> list[str]:
    """The `mlc-cli` arguments the launcher runs."""
    if mode is Mode.plan:
        return ["plan", "--model", preset.name, "--hardware", settings.hardware, "--seq-len", str(settings.seq_len),
                "--batch", str(BATCH)]
    if mode is Mode.train:
        seq = max(16, -(-min(settings.seq_len, 4096) // 16) * 16)  # LoRA rows are padded to multiples of 16
        return ["train", f"model={model_dir}", f"max_seq_len={seq}", f"device={device}"]
    parallel = ["--tensor-parallel-size", str(settings.tensor_parallel)] if settings.tensor_parallel > 1 else []
    parallel += ["--enable-expert-parallel"] if settings.expert_parallel else []
    return ["serve", "--model", model_dir, "--device", device, "--max-seq-len", str(settings.seq_len),
            "--weight-dtype", settings.weight_dtype, "--kv-cache-dtype", settings.kv_cache_dtype,
            "--max-batch-size", str(settings.max_batch_size), *parallel]


def show(preset, settings, args: list[str]) -> None:
    table = Table(title=f"{preset.title} on {settings.hardware} ({settings.device})", show_header=False)
    for label, value in (("seq_len", settings.seq_len), ("weights", settings.weight_dtype),
                         ("kv cache", settings.kv_cache_dtype),
                         ("sparse kv ratio", settings.sparse_kv_ratio or "off"),
                         ("max batch", settings.max_batch_size), ("devices (plan)", settings.devices),
                         ("tensor parallel", f"{settings.tensor_parallel}"
                          f"{' with expert parallel' if settings.expert_parallel else ''}"),
                         ("fits", "yes" if settings.fits else "no"), ("why", settings.reason)):
        table.add_row(label, str(value))
    console.print(table)
    for note in settings.notes:
        console.print(f"note: {note}", highlight=False)
    if settings.sparse_kv_ratio:
        console.print(f"note: the plan keeps {settings.sparse_kv_ratio:g} of old tokens (sparse KV); set "
                      "engine.sparse_kv in a serve.yaml to use it", highlight=False)
    console.print("running: mlc-cli " + " ".join(args), highlight=False)


def make_command(alias: str):
    def launch(
        mode: Mode = typer.Option(Mode.inference, "--mode", help="inference (serve), train (LoRA) or plan."),
        seq_len: Optional[int] = typer.Option(None, "--seq-len", min=16, help="Tokens per sequence."),
        device_id: Optional[int] = typer.Option(None, "--device-id", min=0, help="Accelerator index to run on."),
    ) -> None:
        from mlc.cli import main as cli_main
        from mlc.cluster.presets import detect_hardware, find_preset, recommend, weights_dir

        preset = find_preset(alias)
        hw = detect_hardware()
        device = device_for(hw.device, device_id)
        model_dir = None if mode is Mode.plan else model_arg(preset, weights_dir(preset))
        settings = recommend(preset, hw, seq_len or preset.seq_len)
        if mode is not Mode.plan and (not settings.fits or settings.devices > hw.count):
            raise ConfigError(f"{preset.title} does not fit this machine at --seq-len {settings.seq_len}: the plan "
                              f"needs {settings.devices} {hw.device} device(s), it has {hw.count}; see "
                              f"`mlc-cli {alias} --mode plan`, or lower --seq-len")
        args = command_for(mode, preset, settings, model_dir, device)
        show(preset, settings, args)
        code = cli_main.app(args=args, prog_name="mlc-cli", standalone_mode=False)
        if code:
            raise typer.Exit(code)

    return launch


def register(app: typer.Typer) -> None:
    from mlc.cluster.presets import PRESETS

    for preset in PRESETS:
        for i, alias in enumerate(preset.aliases):
            app.command(alias, hidden=i > 0, help=f"Launcher: {preset.title} with the settings `plan` recommends "
                        "here (--mode inference|train|plan).")(make_command(alias))
