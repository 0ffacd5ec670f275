"""`mlc-cli generate`: complete one prompt, or every line of a JSONL file, offline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mlc.bench.prompts import read_prompt_rows
from mlc.cli.engine_options import EngineArgs, engine_options
from mlc.errors import InvalidRequestError

console = Console()


def register(app: typer.Typer) -> None:
    @app.command()
    @engine_options()
    def generate(
        prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="Prompt text.")] = None,
        prompts_file: Annotated[Optional[Path], typer.Option(
            "--prompts-file", "--prompt-file", help="JSONL of prompts.")] = None,
        chat: Annotated[bool, typer.Option("--chat", help="Wrap --prompt in the model's chat template.")] = False,
        output: Annotated[Optional[Path], typer.Option(
            "--out", "-o", "--output", help="Write results as JSONL here.")] = None,
        max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n")] = 128,
        temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: Annotated[Optional[int], typer.Option(
            help="Sampling seed of every prompt (same seed, same output, batched or not).")] = None,
        stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable).")] = None,
        *,
        engine: EngineArgs,
    ) -> None:
        """Generate text offline (no server)."""
        from mlc.engine.llm import LLM
        from mlc.engine.sampling_params import SamplingParams

        if (prompt is None) == (prompts_file is None):
            raise InvalidRequestError("give exactly one of --prompt or --prompts-file")
        rows: list[dict[str, Any]] = (read_prompt_rows(prompts_file) if prompts_file
                                      else [{"prompt": prompt, "chat": chat}])
        cfg = engine.resolve()
        llm = LLM(config=cfg)
        prompts, params = [], []
        for row in rows:
            if "messages" in row:
                prompts.append(llm.render_chat(row["messages"]))
            elif row.get("chat"):
                prompts.append(llm.render_chat([{"role": "user", "content": row["prompt"]}]))
            else:
                prompts.append(row["prompt"])
            params.append(SamplingParams(
                max_new_tokens=int(row.get("max_new_tokens", max_new_tokens)),
                temperature=float(row.get("temperature", temperature)), top_p=top_p, top_k=top_k,
                seed=row.get("seed", seed), stop=list(stop or []),
            ))
        if len(rows) == 1 and output is None:
            out = llm.generate(prompts, params)[0]
            if out.error is not None:
                raise out.error
            console.print(out.outputs[0].text, highlight=False, markup=False)
            return
        with Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=Console(stderr=True), transient=False) as bar:
            task = bar.add_task("gen", total=len(prompts))
            outs = llm.generate(prompts, params, on_progress=lambda _: bar.advance(task))
        lines = [
            json.dumps({"id": row.get("id", i), "text": o.outputs[0].text, "finish_reason": o.outputs[0].finish_reason,
                        "prompt_tokens": len(o.prompt_token_ids), "completion_tokens": len(o.outputs[0].token_ids),
                        **({"error": o.error.message} if o.error is not None else {})},
                       ensure_ascii=False)
            for i, (row, o) in enumerate(zip(rows, outs))
        ]
        if output:
            output.write_text("\n".join(lines) + "\n", encoding="utf-8")
            console.print(f"wrote {len(lines)} results to {output}")
        else:
            for line in lines:
                console.print(line, highlight=False, markup=False)
