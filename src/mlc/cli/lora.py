"""`mlc-cli lora list | load | unload --url URL`: a running server's LoRA adapters, through its routes
(`/v1/lora_adapters`, `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`; the server needs --enable-lora-loading
to load or unload)."""

from __future__ import annotations

import os
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from mlc.errors import InvalidRequestError, MlcError, NetworkError

console = Console()
lora_app = typer.Typer(help="List, load and unload a running server's LoRA adapters (its /v1/*lora_adapter routes).",
                       no_args_is_help=True)

Url = Annotated[str, typer.Option("--url", help="The server.")]
Key = Annotated[Optional[str], typer.Option(
    "--api-key", help="Bearer key; default: MLC_ADMIN_API_KEY, else MLC_API_KEY.", show_default=False)]


def _call(method: str, url: str, path: str, key: str | None, body: dict[str, Any] | None = None) -> dict[str, Any]:
    import httpx

    key = key or os.environ.get("MLC_ADMIN_API_KEY") or os.environ.get("MLC_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.request(method, url.rstrip("/") + path, json=body, headers=headers, timeout=120)
    except httpx.HTTPError as e:
        raise NetworkError(f"cannot reach {url} ({e}); is `mlc-cli serve` running there?") from None
    try:
        data: dict[str, Any] = r.json()
    except ValueError:
        data = {}
    if r.status_code >= 400:
        message = (data.get("error") or {}).get("message") or r.text[:200]
        err = MlcError(f"{r.status_code} from {url}{path}: {message}")
        err.exit_code = 1 if r.status_code >= 500 else 2
        raise err
    return data


@lora_app.command("list")
def list_cmd(url: Url = "http://127.0.0.1:8080", api_key: Key = None) -> None:
    """The adapters loaded on the server, with their base model, rank and path."""
    data = _call("GET", url, "/v1/lora_adapters", api_key)["data"]
    table = Table("name", "parent", "rank", "pinned", "targets", "path")
    for a in data:
        table.add_row(a["id"], a["parent"], str(a["rank"]), "yes" if a["pinned"] else "",
                      ",".join(a["target_modules"]), a["path"])
    console.print(table if data else "no LoRA adapters loaded")


@lora_app.command("load")
def load_cmd(name: Annotated[str, typer.Argument(help="The name requests select it by (model=NAME).")],
             path: Annotated[str, typer.Argument(help="The adapter's directory, as the server sees it (inside its "
                                                 "--lora-dir / --allowed-lora-paths).")],
             url: Url = "http://127.0.0.1:8080", api_key: Key = None,
             pinned: Annotated[bool, typer.Option("--pinned", help="Never evicted for room.")] = False,
             replace: Annotated[bool, typer.Option("--replace", help="Replace a loaded adapter of this name.")]
             = False) -> None:
    """Load a PEFT adapter into the running server (streams in flight go on)."""
    if not name or not path:
        raise InvalidRequestError("give the adapter's NAME and PATH")
    card = _call("POST", url, "/v1/load_lora_adapter", api_key,
                 {"lora_name": name, "lora_path": path, "pinned": pinned, "load_inplace": replace})
    console.print(f"loaded {card['id']} (rank {card['rank']}, on {card['parent']}) from {card['path']}",
                  highlight=False)


@lora_app.command("unload")
def unload_cmd(name: Annotated[str, typer.Argument(help="The adapter's name.")],
               url: Url = "http://127.0.0.1:8080", api_key: Key = None) -> None:
    """Unload an adapter (refused with 409 while requests use it: retry once they finish)."""
    _call("POST", url, "/v1/unload_lora_adapter", api_key, {"lora_name": name})
    console.print(f"unloaded {name}", highlight=False)


def register(app: typer.Typer) -> None:
    app.add_typer(lora_app, name="lora")
