"""One serving replica: the server's own FastAPI app (`mlc.server.app.create_app`, so health, both APIs, streaming,
auth, audit and metrics are the same code as `mlc-cli serve`) driven in-process by the gateway's forwarded
requests. The constructor returns once the model is loaded, so Ray Serve counts a replica as running only when it
can answer; a dead engine fails the health check and Serve replaces the replica."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator

from mlc.cluster.asgi_bridge import ForwardedRequest, ResponseStart, run_asgi
from mlc.cluster.lora_sync import sync
from mlc.cluster.stage_hosts import node_address

log = logging.getLogger("mlc.cluster.replica")



class ReplicaServer:
    async def __init__(self, spec: dict):  # type: ignore[misc]  # Ray Serve awaits a deployment's async __init__
        import ray
        from ray import serve

        from mlc.cluster.registry import get_registry
        from mlc.config.serve_config import ServeConfig
        from mlc.errors import ClusterError
        from mlc.server.app import create_app
        from mlc.server.observability.hooks import HooksConfig
        from mlc.server.state import ERROR, LOADING

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.config = ServeConfig(**spec["serve"])
        if spec.get("kv_token"):  # prefill/decode: the KV sender's store and receivers listen on this node's address
            self.config = self.config.model_copy(update={"host": node_address()})
        self.stages = place_stages(spec)
        self.generation = spec.get("generation", 0)
        self.app = create_app(self.config, HooksConfig(**spec.get("hooks", {})))
        self.state = self.app.state.mlc
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        while self.state.status == LOADING:
            await asyncio.sleep(0.1)
        if self.state.status == ERROR:
            await self._lifespan.__aexit__(None, None, None)
            raise ClusterError(f"the replica could not serve {self.config.engine.model}: {self.state.error}")
        self.id = serve.get_replica_context().replica_id.unique_id
        self.node = node_address()
        self.side = await open_side_channel(self.state, self.node, spec.get("kv_token"))
        self.node_id = ray.get_runtime_context().get_node_id()
        self.started = time.time()
        self.registry = get_registry()
        self._push_s = float(spec.get("push_s", 1.0))
        self._synced_loras: set[str] = set()  # adapters this replica loaded from the deployment's list
        self._pusher = asyncio.create_task(self._push_loop())

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        async for item in run_asgi(self.app, request, self.id):
            yield item

    def check_health(self) -> None:
        from mlc.server.state import ERROR

        engine_error = self.state.engine.error if self.state.engine is not None else None
        if self.state.status == ERROR or engine_error is not None:
            raise RuntimeError(f"engine failed: {self.state.error or engine_error}")

    def snapshot(self) -> dict:
        stats = self.state.stats()
        engine = self.state.engine
        adapters = engine.adapter_names if engine is not None else list(self.config.engine.lora_adapters)
        return {
            "id": self.id, "node": self.node, "pid": os.getpid(), "generation": self.generation,
            "model": self.config.engine.model, "served_model_name": self.state.model_id,
            "adapters": sorted(adapters), "status": self.state.status,
            "in_flight": len(self.state.active), "running": stats.num_running if stats else 0,
            "waiting": self.state.waiting(), "kv_cache_usage": stats.kv_cache_usage if stats else 0.0,
            "prefix_cache_hits": stats.prefix_cache_hits if stats else 0,
            "prefix_cache_queries": stats.prefix_cache_queries if stats else 0,
            "started": self.started, "metrics": self.state.metrics.render().decode(),
            "node_id": self.node_id, "stages": self.stages.nodes() if self.stages is not None else [],
            "role": self.config.kv_role,
        }

    async def _push_loop(self) -> None:
        while True:
            try:
                if self.registry is not None:
                    await self.registry.report.remote(self.snapshot())
                    await sync(self.state, await self.registry.loras.remote(), self._synced_loras)
            except Exception as e:  # the registry restarting: post again next round
                log.warning("could not post to the registry: %s", e)
            await asyncio.sleep(self._push_s)

    async def __del__(self) -> None:
        pusher = getattr(self, "_pusher", None)
        if pusher is not None:
            pusher.cancel()
        if getattr(self, "registry", None) is not None:
            try:
                await self.registry.remove.remote(self.id)
            except Exception:  # the registry is gone too (deploy down): nothing to tidy
                pass
        if getattr(self, "side", None) is not None:
            await self.side.stop()
        if getattr(self, "_lifespan", None) is not None:
            await self._lifespan.__aexit__(None, None, None)


async def open_side_channel(state, host: str, token: str | None):
    """A replica of a prefill/decode layout shares the deployment's token; a prefill replica also serves the
    connector's routes on its node (`cluster/pd_side.py`) and names that address in its KV handles."""
    pd = state.pd
    if token is None or pd is None:
        return None
    pd.token = token
    if pd.role == "decode":
        return None
    from mlc.cluster.pd_side import SideChannel

    side = SideChannel(state, host, token)
    pd.side_url = await side.start()
    return side


def place_stages(spec: dict):
    """A replica deployed with pipeline stages in a placement group (`stage_bundles` in its spec) starts them there,
    one bundle each: the launcher its engine will use. None for a replica whose engine is one process."""
    bundles = spec.get("stage_bundles")
    if not bundles:
        return None
    from ray.util import get_current_placement_group

    from mlc.cluster.stage_hosts import RayStageLauncher
    from mlc.engine.launch import use_launcher
    from mlc.errors import ClusterError

    group = get_current_placement_group()
    if group is None:
        raise ClusterError("this replica was deployed for pipeline stages in a placement group but runs outside one")
    launcher = RayStageLauncher(group, bundles, int(spec.get("ranks_per_stage", 1)))
    use_launcher(launcher)
    return launcher
