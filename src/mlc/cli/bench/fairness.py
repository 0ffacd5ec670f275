"""`mlc-cli bench fairness`: one API key's latency beside another key's flood (issue 33's fairness goal)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

console = Console()


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("fairness")
    def fairness(
        url: Annotated[Optional[str], typer.Option(
            help="A running server started with --api-key-file (give --quiet-key and --flood-key); default: start "
                 "`mlc-cli serve` on its defaults with a key file of its own.")] = None,
        model: Annotated[Optional[str], typer.Option(help="The model to serve; default: the default model.")] = None,
        server_arg: Annotated[Optional[list[str]], typer.Option(
            "--server-arg", help="Extra flag for the started server, repeatable.")] = None,
        quiet_key: Annotated[Optional[str], typer.Option(help="With --url: the quiet key.")] = None,
        flood_key: Annotated[Optional[list[str]], typer.Option(
            help="With --url: the flooding key (repeatable: one a round, so each round finds its minute "
                 "empty).")] = None,
        flood_limit: Annotated[int, typer.Option(
            help="The flood key's requests_per_minute; it sends ten times that.")] = 60,
        rounds: Annotated[int, typer.Option(help="Rounds of (quiet alone, quiet beside the flood).")] = 3,
        seconds: Annotated[float, typer.Option(help="Length of each phase of a round.")] = 20.0,
        quiet_rps: Annotated[float, typer.Option(help="The quiet key's requests a second at most.")] = 2.0,
        max_tokens: Annotated[int, typer.Option(help="Tokens each request asks for.")] = 16,
        out: Annotated[Optional[Path], typer.Option(
            "--out", help="Directory for fairness.json, the key file and the server log "
                          "(default: bench-fairness-<time>).")] = None,
    ) -> None:
        """A quiet key's p99 TTFT alone, then beside a key that floods at 10x its requests-per-minute limit
        (goal: within 1.25x). Exits 1 when the goal is missed."""
        from mlc.bench.key_fairness import FairnessConfig, run_fairness
        from mlc.errors import InvalidRequestError

        if min(flood_limit, rounds, max_tokens) < 1 or seconds <= 0 or quiet_rps <= 0:
            raise InvalidRequestError("--flood-limit, --rounds and --max-tokens must be at least 1, --seconds and "
                                      "--quiet-rps above 0")
        if url is not None and (not quiet_key or not flood_key):
            raise InvalidRequestError("with --url, give the server's keys: --quiet-key KEY --flood-key KEY (the "
                                      "flood key with requests_per_minute = --flood-limit in its key file)")
        out_dir = out or Path(time.strftime("bench-fairness-%Y%m%d-%H%M%S"))
        cfg = FairnessConfig(out_dir=out_dir, url=url.rstrip("/") if url else None, model=model,
                             server_args=list(server_arg or []), quiet_key=quiet_key, flood_keys=list(flood_key or []),
                             flood_limit=flood_limit, rounds=rounds, seconds=seconds, quiet_rps=quiet_rps,
                             max_tokens=max_tokens)
        result = run_fairness(cfg, progress=lambda msg: console.print(msg, highlight=False))
        (out_dir / "fairness.json").write_text(json.dumps(result, indent=1) + "\n")
        a, b = result["quiet_alone"], result["quiet_with_flood"]
        console.print(f"quiet key p99 TTFT: {1000 * a['p99_ttft_s']:.1f} ms alone ({a['n']} requests), "
                      f"{1000 * b['p99_ttft_s']:.1f} ms beside the flood ({b['n']}): {result['p99_ratio']:.2f}x "
                      f"(goal <= {result['goal']}x: {'met' if result['goal_met'] else 'NOT met'})", highlight=False)
        console.print(f"wrote {out_dir}/fairness.json")
        if not result["goal_met"]:
            raise typer.Exit(1)
