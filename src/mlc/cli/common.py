"""Options shared by the commands that run the engine, and the one place they become an EngineConfig."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from mlc.config.engine_config import EngineConfig
from mlc.errors import ConfigError

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Store name, HF checkpoint dir or .gguf file.")]
DeviceOpt = Annotated[str, typer.Option(help="cpu, cuda, cuda:N, npu or auto.")]
DtypeOpt = Annotated[str, typer.Option(help="Compute dtype: auto (fp32 on CPU), fp32, fp16, bf16.")]
WeightDtypeOpt = Annotated[Optional[str], typer.Option(
    "--weight-dtype", help="auto, fp16, bf16 (storage), int8 (W8A8/W8A16 mixed), int4 (W4A16, groups of 32).")]
KVDtypeOpt = Annotated[Optional[str], typer.Option("--kv-cache-dtype", help="auto, fp32, fp16, bf16, int8, int4.")]
KVMemOpt = Annotated[Optional[str], typer.Option("--kv-cache-memory", help="KV cache budget, e.g. 512MiB or 4GiB.")]
PageSizeOpt = Annotated[Optional[int], typer.Option("--page-size", help="Tokens per KV page (default 16).")]
BatchOpt = Annotated[Optional[int], typer.Option("--max-batch-size", help="Max running sequences (default 8).")]
SeqLenOpt = Annotated[Optional[int], typer.Option("--max-seq-len", help="Max prompt + output tokens per sequence.")]
TokensOpt = Annotated[Optional[int], typer.Option("--max-num-batched-tokens", help="Token budget per step.")]
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", help="YAML config file; flags override it.")]


def engine_config(config: Path | None = None, **flags) -> EngineConfig:
    """EngineConfig from an optional YAML file (its `engine:` section, or the whole file), then the given flags."""
    base: dict = {}
    if config is not None:
        import yaml

        try:
            raw = yaml.safe_load(Path(config).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{config}: cannot read ({e})") from None
        base = dict(raw.get("engine", raw)) if isinstance(raw, dict) else {}
    base.update({k: v for k, v in flags.items() if v is not None})
    from pydantic import ValidationError

    try:
        return EngineConfig(**base)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{config or 'options'}: {where}: {first['msg']}") from None
