"""Run-time LoRA adapters on a cluster (issue 31): the gateway records a successful load or unload in the registry,
and each replica follows the registry's list (a restarted one loads it all; an adapter in use unloads later)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from mlc.cluster.lora_sync import LOAD_PATH, UNLOAD_PATH, change, record, sync
from mlc.config.serve_config import ServeConfig
from mlc.engine.lora_manager import AdapterConflictError
from mlc.server.lora_paths import LoRAPaths


class Remote:
    def __init__(self, fn):
        self.remote = fn


class FakeRegistry:
    def __init__(self):
        self.loras: dict[str, dict] = {}

        async def set_lora(name, entry):
            self.loras[name] = entry

        async def drop_lora(name):
            self.loras.pop(name, None)

        self.set_lora, self.drop_lora = Remote(set_lora), Remote(drop_lora)


class FakeEngine:
    def __init__(self, own=()):
        self.adapter_names = list(own)
        self.busy: set[str] = set()
        self.loads: list[tuple[str, str, bool]] = []

    async def load_lora(self, name, path, pinned=False):
        self.loads.append((name, path, pinned))
        self.adapter_names.append(name)

    async def unload_lora(self, name):
        if name in self.busy:
            raise AdapterConflictError(f"{name} has 1 request(s) in flight")
        self.adapter_names.remove(name)


def body(**kw) -> bytes:
    return json.dumps(kw).encode()


def test_only_successful_adapter_requests_change_the_deployments_list():
    registry = FakeRegistry()
    load = body(lora_name="a", lora_path="/d/a", pinned=True)
    asyncio.run(record(registry, LOAD_PATH, load, 400))
    asyncio.run(record(registry, "/v1/completions", load, 200))
    assert registry.loras == {}
    asyncio.run(record(registry, LOAD_PATH, load, 200))
    assert registry.loras == {"a": {"path": "/d/a", "pinned": True}}
    asyncio.run(record(registry, UNLOAD_PATH, body(lora_name="a"), 409))
    assert "a" in registry.loras
    asyncio.run(record(registry, UNLOAD_PATH, body(lora_name="a"), 200))
    assert registry.loras == {} and change(LOAD_PATH, b"not json", 200) is None


def test_a_replica_follows_the_list_and_never_touches_its_own_adapters(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    engine = FakeEngine(own=["started_with"])
    state = SimpleNamespace(engine=engine, config=ServeConfig(enable_lora_loading=True, lora_dirs=[str(tmp_path)]),
                            lora_paths=LoRAPaths([str(tmp_path)], []))
    synced: set[str] = set()
    wanted = {"a": {"path": str(tmp_path / "a"), "pinned": False}, "b": {"path": str(tmp_path / "b"), "pinned": True},
              "evil": {"path": "/etc", "pinned": False}}
    asyncio.run(sync(state, wanted, synced))  # a restarted replica: everything at its first round
    assert engine.loads == [("a", str(tmp_path / "a"), False), ("b", str(tmp_path / "b"), True)]
    assert synced == {"a", "b"}  # a path outside this replica's allowed directories is not loaded
    engine.busy.add("a")
    asyncio.run(sync(state, {}, synced))
    assert engine.adapter_names == ["started_with", "a"] and synced == {"a"}  # in use: later
    engine.busy.clear()
    asyncio.run(sync(state, {}, synced))
    assert engine.adapter_names == ["started_with"] and synced == set()
    state.config = ServeConfig()  # loading at run time off: the list is ignored
    asyncio.run(sync(state, wanted, synced))
    assert engine.adapter_names == ["started_with"]
