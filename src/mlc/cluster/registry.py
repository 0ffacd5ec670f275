"""The deployment's notice board, a small detached Ray actor: each replica posts a snapshot of itself every second
(health, load, its Prometheus text), `deploy` records what it deployed, and the gateway the LoRA adapters loaded at
run time (which every replica follows, `lora_sync.py`). The gateway's /metrics and
`mlc-cli deploy status` read it."""

from __future__ import annotations

import time

import ray

from mlc.cluster.ray_runtime import NAMESPACE

REGISTRY_NAME = "mlc-registry"
STALE_S = 10.0  # a replica silent for this long is dead or stuck: left out of /metrics, shown as such in status
FORGET_S = 60.0  # and after this long it is dropped (Serve has replaced it)


@ray.remote(num_cpus=0, max_restarts=-1)
class Registry:
    def __init__(self):
        self._snapshots: dict[str, dict] = {}
        self._spec: dict | None = None
        self._loras: dict[str, dict] = {}  # adapters loaded at run time: every replica follows (lora_sync.py)

    def report(self, snapshot: dict) -> None:
        self._snapshots[snapshot["id"]] = {**snapshot, "seen": time.time()}

    def remove(self, replica_id: str) -> None:
        self._snapshots.pop(replica_id, None)

    def snapshots(self, max_age_s: float | None = None) -> list[dict]:
        now = time.time()
        for rid in [r for r, s in self._snapshots.items() if now - s["seen"] > FORGET_S]:
            del self._snapshots[rid]
        return [{**s, "age_s": now - s["seen"]} for s in self._snapshots.values()
                if max_age_s is None or now - s["seen"] <= max_age_s]

    def set_spec(self, spec: dict) -> None:
        self._spec = spec

    def spec(self) -> dict | None:
        return self._spec

    def set_lora(self, name: str, entry: dict) -> None:
        self._loras[name] = entry

    def drop_lora(self, name: str) -> None:
        self._loras.pop(name, None)

    def loras(self) -> dict[str, dict]:
        return dict(self._loras)


def get_registry(create: bool = False):
    """The registry actor handle (created when `create`); None when it does not exist."""
    if create:
        # @ray.remote made Registry an actor class; Ray's types keep the plain class
        return Registry.options(  # type: ignore[attr-defined]
            name=REGISTRY_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True).remote()
    try:
        return ray.get_actor(REGISTRY_NAME, namespace=NAMESPACE)
    except ValueError:
        return None
