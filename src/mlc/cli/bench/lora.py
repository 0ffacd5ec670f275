"""`mlc-cli bench lora`: LoRA serving against its goals (issue 31), in process: base vs one adapter vs one adapter
per stream, and adapter load latency while streams decode."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from mlc.cli.engine_options import option

console = Console()


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("lora")
    def lora(
        model: Annotated[Optional[str], option("model")] = None,
        streams: Annotated[int, typer.Option(help="Concurrent greedy streams.")] = 32,
        tokens: Annotated[int, typer.Option(help="Tokens per stream.")] = 64,
        rank: Annotated[int, typer.Option(help="Rank of the random adapters (on every linear layer).")] = 8,
        loads: Annotated[int, typer.Option(help="Adapters loaded while base streams decode.")] = 8,
        kv_cache_memory: Annotated[str, typer.Option(help="KV cache budget.")] = "512MiB",
        threads: Annotated[Optional[int], typer.Option(help="CPU threads (default: torch's).")] = None,
        out: Annotated[Optional[Path], typer.Option(help="Write the results here as JSON.")] = None,
    ) -> None:
        """Decode tokens/s of `streams` streams on the base model, on one adapter, and on `streams` distinct
        adapters (goals: >= 0.85x base, >= 0.9x one adapter); adapter load time while serving (goal: median
        <= 100 ms) and the step gap it causes (goal: <= 2x the p99 gap)."""
        from mlc.bench.lora import LoRABenchConfig, run_lora_bench
        from mlc.config.engine_config import EngineConfig
        from mlc.errors import InvalidRequestError

        if min(streams, tokens, rank) < 1 or loads < 0:
            raise InvalidRequestError("--streams, --tokens and --rank must be at least 1, --loads at least 0")
        cfg = LoRABenchConfig(model=model or EngineConfig().model, streams=streams, tokens=tokens, rank=rank,
                              loads=loads, kv_cache_memory=kv_cache_memory,
                              engine={"num_threads": threads} if threads else {})
        result = run_lora_bench(cfg, progress=lambda msg: console.print(msg, highlight=False))
        text = json.dumps(result, indent=2)
        console.print_json(text)
        if out is not None:
            out.write_text(text + "\n")
            console.print(f"wrote {out}")
