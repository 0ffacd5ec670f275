"""Run-time LoRA adapters on a cluster: the deployment's adapter set lives in the registry, and every replica
follows it.

- The gateway forwards `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` to one replica like any request;
  that replica checks and loads (or unloads) it and answers the client. On a 200 the gateway records the change in
  the registry (`record`), so a refused load changes nothing anywhere.
- Each replica, every push round (about a second), loads the registry's adapters it lacks and unloads the ones it
  loaded from there that the registry no longer holds (`sync`); a replica that restarts loads them all at its first
  round. An adapter still in use on a replica is unloaded there at a later round (its 409 is not an error here).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from mlc.errors import MlcError

log = logging.getLogger("mlc.cluster.lora")

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"


def change(path: str, request_body: bytes, status: int) -> tuple[str, str, dict[str, Any] | None] | None:
    """What a forwarded adapter request did, when it succeeded: ("load", name, {path, pinned}) or
    ("unload", name, None); None for anything else."""
    if status != 200 or path not in (LOAD_PATH, UNLOAD_PATH):
        return None
    try:
        body = json.loads(request_body)
        name = str(body["lora_name"])
    except (ValueError, KeyError, TypeError):
        return None
    if path == UNLOAD_PATH:
        return "unload", name, None
    return "load", name, {"path": str(body.get("lora_path", "")), "pinned": bool(body.get("pinned", False))}


async def record(registry: Any, path: str, request_body: bytes, status: int) -> None:
    """Note a successful load or unload in the registry (an actor handle: `set_lora` / `drop_lora`)."""
    done = change(path, request_body, status)
    if done is None or registry is None:
        return
    kind, name, entry = done
    if kind == "load":
        await registry.set_lora.remote(name, entry)
    else:
        await registry.drop_lora.remote(name)


async def sync(state: Any, wanted: dict[str, dict[str, Any]], synced: set[str]) -> None:
    """Bring this replica's adapters to `wanted` (name -> {path, pinned}); `synced`: the names this replica holds
    because of the registry (its own `--lora` adapters are never touched)."""
    engine = state.engine
    if engine is None or state.config is None or not state.config.enable_lora_loading:
        return
    loaded = set(engine.adapter_names)
    for name, entry in wanted.items():
        if name in loaded:
            synced.add(name)
            continue
        try:
            path = state.lora_paths.check(entry["path"])
            await engine.load_lora(name, str(path), bool(entry.get("pinned")))
            synced.add(name)
            log.info("LoRA adapter %r loaded from the deployment's list", name)
        except MlcError as e:
            log.warning("LoRA adapter %r from the deployment's list did not load here: %s", name, e.message)
    for name in sorted(synced - set(wanted)):
        try:
            if name in engine.adapter_names:
                await engine.unload_lora(name)
            synced.discard(name)
        except MlcError as e:  # in use here: unloaded at a later round
            log.info("LoRA adapter %r stays until its requests finish (%s)", name, e.message)
