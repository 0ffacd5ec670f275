"""Options shared by the commands that run the engine (generate, chat, serve, bench), and their dotted config keys."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from mlc.config.engine_config import EngineConfig

# Optional: serve leaves a flag it was not given to its config file; generate and chat give defaults.
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", help="Store name, HF checkpoint dir, org/name in the local HF cache, or .gguf file.")]
DeviceOpt = Annotated[Optional[str], typer.Option(help="cpu, cuda, cuda:N, npu or auto.")]
DtypeOpt = Annotated[Optional[str], typer.Option(help="Compute dtype: auto (fp32 on CPU), fp32, fp16, bf16.")]
WeightDtypeOpt = Annotated[Optional[str], typer.Option(
    "--weight-dtype", help="auto, fp16, bf16 (storage), int8 (W8A8/W8A16 mixed), int4 (W4A16, groups of 32).")]
KVDtypeOpt = Annotated[Optional[str], typer.Option(
    "--kv-cache-dtype", "--kv-dtype", help="auto, fp32, fp16, bf16, int8, int4.")]
KVMemOpt = Annotated[Optional[str], typer.Option("--kv-cache-memory", help="KV cache budget, e.g. 512MiB or 4GiB.")]
PageSizeOpt = Annotated[Optional[int], typer.Option(
    "--page-size", "--block-size", help="Tokens per KV page (default 16).")]
BatchOpt = Annotated[Optional[int], typer.Option(
    "--max-batch-size", "--batch", "--max-num-seqs", help="Max running sequences (default: sized from the KV cache).")]
SeqLenOpt = Annotated[Optional[int], typer.Option(
    "--max-seq-len", "--seq-len", "--max-model-len", help="Max prompt + output tokens per sequence.")]
TokensOpt = Annotated[Optional[int], typer.Option("--max-num-batched-tokens", help="Token budget per step.")]
TPOpt = Annotated[Optional[int], typer.Option(
    "--tensor-parallel-size", "--tp", help="Split the model over N ranks, one process each (gloo on CPU, nccl on "
    "CUDA, hccl on Ascend); default 1.")]
EPOpt = Annotated[Optional[bool], typer.Option(
    "--enable-expert-parallel", help="MoE models: spread whole experts over the tensor-parallel ranks instead of "
    "splitting every expert.")]
CompileOpt = Annotated[Optional[bool], typer.Option(
    "--compile/--no-compile", help="Run the forward pass as one torch.compile graph (Llama and GLM-4 dense, one "
    "rank, no LoRA; needs a C++ compiler): faster small batches after a one-time compile (default off).")]
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", help="YAML config file; flags override it.")]
VerifyOpt = Annotated[Optional[bool], typer.Option(
    "--verify", help="Check every byte of a store model against its manifest before loading (default: sizes and "
    "sampled hashes).")]


def engine_overrides(**flags: Any) -> dict[str, Any]:
    """Engine flags (`device="cuda"`) as serve config keys (`engine.device`); None still means "not given"."""
    return {f"engine.{name}": value for name, value in flags.items()}


def engine_config(config: Path | None = None, **flags) -> EngineConfig:
    """The engine section of a serve config file (`engine:` or its flat engine keys), then the given flags, then
    the tutorial's ASCEND_MAX_MEM; prints a note for each key, flag or variable translated."""
    from mlc.config.loader import load_config
    from mlc.config.serve_config import ServeConfig

    notes: list[str] = []
    cfg = load_config(config, ServeConfig, engine_overrides(**flags), notes=notes).engine
    print_notes(notes + ascend_notes(cfg))
    if cfg.verify:
        verify_model(cfg.model, full=True)
    return cfg


def verify_model(model: str, full: bool) -> None:
    """A store model against its manifest before anything loads (the engine's own load runs the cheap check)."""
    from mlc.models.store import resolve_model_dir
    from mlc.models.store_verify import check_at_load

    check_at_load(resolve_model_dir(model), full=full)


def ascend_notes(cfg: EngineConfig) -> list[str]:
    """ASCEND_MAX_MEM / ASCEND_ALLOC_MEM from the environment applied to `cfg` (see mlc/config/ascend_env.py)."""
    import os

    from mlc.config.ascend_env import apply_ascend_env

    return apply_ascend_env(cfg, os.environ)


def print_notes(notes: list[str]) -> None:
    """One line on stderr per translated key, flag or variable."""
    from rich.console import Console
    from rich.markup import escape

    err = Console(stderr=True)
    for note in notes:
        err.print(f"[cyan]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
