"""The engine's LoRA adapters at run time: names, ids, use counts, capacity and eviction.

- An adapter id is never reused: a request that resolved a name just before it was unloaded fails with a 404
  instead of meeting another adapter under the same id. The slot its weights occupy is the layers' business.
- Unloading an adapter that a running or waiting request uses is refused (409, with the count): the caller retries
  once they finish. Refusing keeps the rule simple and the engine thread never blocks; the server's unload route
  says so, and the adapter keeps serving.
- `max_cpu_loras` bounds the adapters held in memory: loading one more evicts the least recently used adapter that
  is neither pinned (`--lora` at start, or `pinned` on load) nor in use; an evicted adapter stays known by its path
  and loads again when a request names it (`ensure`). With every adapter pinned or busy, a load gets a 429.
- The prefix cache key of an adapter's pages is its digest (the files' sha256), not its name or id: reloading a
  changed adapter under the same name never reuses the old KV, reloading the same files may.
- `max_loras` (adapters in one batch) is the scheduler's to keep (`Scheduler._admit`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlc.errors import CapacityError, InvalidRequestError, ModelNotFoundError
from mlc.layers.lora import LoRAAdapter

log = logging.getLogger("mlc.engine")


class AdapterConflictError(InvalidRequestError):
    """The adapter name is taken, or the adapter is in use: nothing changed; retry when the condition is gone."""

    http_status = 409
    error_type = "lora_adapter_conflict"


@dataclass
class LoadedAdapter:
    name: str
    path: str
    adapter_id: int
    info: LoRAAdapter
    pinned: bool
    key: int  # the prefix cache's key for this adapter's pages, from its digest
    last_used: float = field(default_factory=time.monotonic)
    loaded_at: float = field(default_factory=time.time)


class LoRAManager:
    def __init__(self, attach: Callable[[int, str, str, Any], LoRAAdapter], detach: Callable[[int], None],
                 users: Callable[[int], int], max_cpu_loras: int | None) -> None:
        self._attach, self._detach, self._users = attach, detach, users
        self.max_cpu_loras = max_cpu_loras
        self.loaded: dict[str, LoadedAdapter] = {}
        self.evicted: dict[str, str] = {}  # name -> path of an adapter evicted for room; reloads on use
        self.by_id: dict[int, LoadedAdapter] = {}
        self._next_id = 1

    def add(self, name: str, path: str, pinned: bool = False, prepared: Any = None) -> LoadedAdapter:
        if name in self.loaded:
            raise AdapterConflictError(f"a LoRA adapter named {name!r} is already loaded; unload it first or pick "
                                       "another name", field="lora_name")
        if self.max_cpu_loras is not None and len(self.loaded) >= self.max_cpu_loras and not self._evictable():
            raise self._full()
        adapter_id = self._next_id
        info = self._attach(adapter_id, name, path, prepared)  # every check first: a refused adapter evicts nobody
        self._next_id += 1
        entry = LoadedAdapter(name, str(path), adapter_id, info, pinned, int(info.digest[:15] or "0", 16) or adapter_id)
        if self.max_cpu_loras is not None and len(self.loaded) >= self.max_cpu_loras:
            self._evict_one()
        self.loaded[name] = self.by_id[adapter_id] = entry
        self.evicted.pop(name, None)
        log.info("LoRA adapter %r loaded from %s (id %d, rank %d, %s)", name, path, adapter_id, info.rank,
                 ",".join(info.target_modules))
        return entry

    def remove(self, name: str) -> None:
        """Unload `name` (an evicted one is forgotten); a 409 while requests use it."""
        entry = self.loaded.get(name)
        if entry is None:
            if self.evicted.pop(name, None) is not None:
                return
            raise ModelNotFoundError(f"no LoRA adapter named {name!r} is loaded; loaded: "
                                     f"{', '.join(self.loaded) or 'none'}", field="lora_name")
        users = self._users(entry.adapter_id)
        if users:
            raise AdapterConflictError(f"LoRA adapter {name!r} has {users} request(s) in flight; unload it once they "
                                       "finish (it keeps serving until then)", field="lora_name")
        self._drop(entry)

    def _drop(self, entry: LoadedAdapter) -> None:
        self._detach(entry.adapter_id)
        del self.loaded[entry.name], self.by_id[entry.adapter_id]

    def _evictable(self) -> list[LoadedAdapter]:
        return [e for e in self.loaded.values() if not e.pinned and not self._users(e.adapter_id)]

    def _full(self) -> CapacityError:
        return CapacityError(f"all {len(self.loaded)} loaded LoRA adapters (--max-cpu-loras {self.max_cpu_loras}) "
                             "are pinned or in use; unload one or raise --max-cpu-loras")

    def _evict_one(self) -> None:
        free = self._evictable()
        if not free:
            raise self._full()
        victim = min(free, key=lambda e: e.last_used)
        self._drop(victim)
        self.evicted[victim.name] = victim.path
        log.info("LoRA adapter %r evicted (least recently used; reloads on its next request)", victim.name)

    def touch(self, adapter_id: int) -> LoadedAdapter:
        entry = self.by_id.get(adapter_id)
        if entry is None:
            raise ModelNotFoundError(f"LoRA adapter id {adapter_id} is no longer loaded (unloaded or evicted "
                                     "meanwhile); retry the request", field="model")
        entry.last_used = time.monotonic()
        return entry

    def describe(self) -> list[dict[str, Any]]:
        return [{"name": e.name, "path": e.path, "id": e.adapter_id, "rank": e.info.rank, "pinned": e.pinned,
                 "targets": e.info.target_modules, "digest": e.info.digest, "created": int(e.loaded_at)}
                for e in list(self.loaded.values())]

