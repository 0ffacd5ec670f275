"""`mlc-cli compile`: fuse, pad and quantize a checkpoint once, into a dir that loads faster."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from mlc.cli.engine_options import option
from mlc.errors import ConfigError

console = Console()


def register(app: typer.Typer) -> None:
    @app.command()
    def compile(
        model: Annotated[str, typer.Option("--model", "-m", help="Store name or HF checkpoint dir.")],
        out: Annotated[Path, typer.Option("--out", "-o", help="Directory to write.")],
        weight_dtype: Annotated[str, typer.Option(help="auto (keep float), fp16, bf16, int8 or int4.")] = "auto",
        group_size: Annotated[int, typer.Option(help="int4 inputs per scale.")] = 32,
        hardware: Annotated[Optional[str], typer.Option(
            help="Profile whose alignment the MLP width is padded to (e.g. ascend-910b).")] = None,
        alignment: Annotated[Optional[int], typer.Option(help="Pad the MLP width to a multiple of this.")] = None,
        overwrite: Annotated[bool, typer.Option(help="Replace --out if it exists.")] = False,
        tensor_parallel_size: Annotated[int, typer.Option(
            "--tensor-parallel-size", "--tp", help="Ranks the output will be served on: checked to shard evenly, "
            "and the MLP width padded so that each rank's slice keeps the alignment.")] = 1,
        enable_expert_parallel: Annotated[Optional[bool], option("enable_expert_parallel")] = None,
    ) -> None:
        """Offline compile: fused q|k|v and gate|up, quantized weights, aligned dims, sha256 manifest."""
        from mlc.layers.quant import check_options
        from mlc.models.compile import compile_model

        check_options(weight_dtype, group_size)
        align = alignment
        if align is None and hardware:
            from mlc.config.hardware import load_profile

            align = load_profile(hardware).alignment
        if tensor_parallel_size > 1:
            from mlc.distributed.checks import check_shardable
            from mlc.models.hf_checkpoint import read_config
            from mlc.models.store import resolve_model_dir

            check_shardable(read_config(resolve_model_dir(model)), tensor_parallel_size, bool(enable_expert_parallel))
            if weight_dtype != "auto":
                raise ConfigError("a tensor-parallel compile keeps the weights in float (--weight-dtype auto); "
                                  "quantize them at load time with `serve --weight-dtype`, each rank its own slice")
            align = (align or 1) * tensor_parallel_size if align else None
        start = time.perf_counter()
        from mlc.cli.progress import progress_bar

        with progress_bar() as bar:
            task = bar.add_task(f"compiling {model}", total=None)

            def step(done: int, total: int, what: str) -> None:
                bar.update(task, completed=done, total=total, description=f"compiling {model}: {what}")

            res = compile_model(model, out, weight_dtype, group_size, alignment=align or 1, overwrite=overwrite,
                                source_note={k: v for k, v in (("hardware", hardware),
                                             ("tensor_parallel_size", tensor_parallel_size)) if v and v != 1} or None,
                                progress=step)
        pad = (f", MLP width {res.padded_intermediate[0]} -> {res.padded_intermediate[1]}"
               if res.padded_intermediate else "")
        console.print(f"compiled {model} -> {res.out_dir} ({res.weight_dtype}, {res.quantized_layers} quantized layers"
                      f"{pad}, {res.bytes_written / 2**20:.0f} MiB) in {time.perf_counter() - start:.1f} s")
