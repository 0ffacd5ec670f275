"""`mlc-cli chat`: an interactive conversation that streams the model's reply."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from mlc.cli.engine_options import EngineArgs, engine_options

console = Console()
HELP = "commands: /reset clears the conversation, /exit (or Ctrl-D) quits"


def register(app: typer.Typer) -> None:
    @app.command()
    @engine_options()
    def chat(
        system: Annotated[Optional[str], typer.Option(help="System prompt.")] = None,
        max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n")] = 512,
        temperature: float = 0.7,
        top_p: float = 0.9,
        seed: Annotated[Optional[int], typer.Option(help="Sampling seed of every reply.")] = None,
        *,
        engine: EngineArgs,
    ) -> None:
        """Chat with a model in the terminal, using its chat template."""
        from mlc.engine.llm import LLM
        from mlc.engine.sampling_params import SamplingParams
        from mlc.errors import MlcError

        cfg = engine.resolve()
        with console.status(f"loading {cfg.model}"):
            llm = LLM(config=cfg)
        console.print(f"[bold]{cfg.model}[/] ready. {HELP}")
        history: list[dict] = [{"role": "system", "content": system}] if system else []
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
        while True:
            try:
                user = console.input("[bold green]you> [/]")
            except EOFError:
                console.print()
                return
            if user.strip() in ("/exit", "/quit"):
                return
            if user.strip() == "/reset":
                history = history[:1] if system else []
                console.print("[dim]conversation cleared[/]")
                continue
            if not user.strip():
                continue
            history.append({"role": "user", "content": user})
            console.print("[bold blue]model> [/]", end="")
            reply = ""
            try:
                for out in llm.stream(llm.render_chat(history), params):
                    piece = out.outputs[0].delta_text
                    reply += piece
                    console.print(piece, end="", highlight=False, markup=False)
            except MlcError as e:
                history.pop()
                console.print(f"\n[red]{escape(e.message)}[/]")
                continue
            console.print()
            history.append({"role": "assistant", "content": reply})
