"""`mlc-cli pd-router`: one endpoint in front of prefill and decode instances (`cluster/pd_router.py`)."""

from __future__ import annotations

from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    @app.command("pd-router")
    def pd_router(
        prefill: Annotated[list[str], typer.Option(
            "--prefill", help="Base URL of a `serve --kv-role prefill` instance (repeatable).")],
        decode: Annotated[list[str], typer.Option(
            "--decode", help="Base URL of a `serve --kv-role decode` instance (repeatable).")],
        host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Port.")] = 8000,
        threshold: Annotated[int, typer.Option(
            "--threshold", help="Prompts shorter than this many tokens (estimated: 4 characters each) prefill on "
            "the decode instance.")] = 256,
    ) -> None:
        """Prefill/decode disaggregation: long prompts prefill on a prefill instance, whose KV pages the decode
        instance pulls over gloo before it streams the answer; short ones run on the decode instance alone."""
        import uvicorn

        from mlc.cluster.pd_router import PDRouter

        uvicorn.run(PDRouter(prefill, decode, threshold), host=host, port=port, log_level="info")
