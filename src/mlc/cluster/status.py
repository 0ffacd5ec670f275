"""`mlc-cli deploy status`: Ray Serve's view of the two applications, and each replica's own report (health, load,
model and adapters) from the registry."""

from __future__ import annotations

from mlc.cluster import ray_runtime
from mlc.cluster.resources import device_kind
from mlc.config.cluster_config import ClusterConfig
from mlc.errors import ClusterError


def status(cluster: ClusterConfig) -> dict:
    """{"endpoint", "applications": {name: {status, message}}, "replicas": [...], "deployed": {...} | None}."""
    import ray
    from ray import serve

    from mlc.cluster.gateway import GATEWAY_APP
    from mlc.cluster.pd_deploy import ALL_REPLICA_APPS
    from mlc.cluster.registry import STALE_S, get_registry

    address = ray_runtime.parse_address(cluster)
    if not ray_runtime.reachable(address.text):
        raise ClusterError(f"no Ray cluster answers at {cluster.ray_address}; nothing is deployed there "
                           "(start one with `mlc-cli deploy --cluster-config ...`)")
    ray_runtime.connect(cluster, device_kind(cluster), start=False)
    try:
        apps = serve.status().applications
        registry = get_registry()
        snapshots = ray.get(registry.snapshots.remote()) if registry is not None else []
        spec = ray.get(registry.spec.remote()) if registry is not None else None
    finally:
        ray.shutdown()
    replicas = []
    current = spec["generation"] if spec else 0
    for s in sorted(snapshots, key=lambda s: (s["node"], s["id"])):
        health = s["status"] if s["age_s"] <= STALE_S else f"silent {s['age_s']:.0f}s"
        if s["generation"] < current and s["age_s"] <= STALE_S:
            health = "draining (replaced by the roll)"
        replicas.append({k: s[k] for k in ("id", "node", "pid", "generation", "model", "adapters", "in_flight",
                                           "running", "waiting", "kv_cache_usage", "prefix_cache_hits",
                                           "prefix_cache_queries")}
                        | {"health": health, "node_id": s.get("node_id", ""), "stages": s.get("stages", []),
                           "role": s.get("role", "both")})
    pools: dict[str, int] = {}  # requests in flight per role (the queue depth of each pool of a PD layout)
    for r in replicas:
        pools[r["role"]] = pools.get(r["role"], 0) + r["in_flight"] + r["waiting"]
    return {
        "endpoint": f"http://{cluster.host}:{cluster.port}",
        "ray_address": cluster.ray_address,
        "applications": {name: {"status": getattr(a.status, "value", str(a.status)), "message": a.message}
                         for name, a in apps.items() if name in (GATEWAY_APP, *ALL_REPLICA_APPS)},
        "replicas": replicas,
        "pools": pools,
        "deployed": None if spec is None else {
            "generation": spec["generation"], "model": spec["serve"]["engine"]["model"],
            "adapters": sorted(spec["serve"]["engine"]["lora_adapters"]),
            "replicas": _deployed_replicas(spec["cluster"])},
    }


def _deployed_replicas(cluster: dict) -> int:
    """The replicas a deployed cluster file runs: data_parallel_size, or a PD layout's prefill and decode pools'."""
    from mlc.cluster.pd_deploy import replica_apps
    from mlc.cluster.resources import pool_replicas

    config = ClusterConfig(**cluster)
    return sum(pool_replicas(config, a.pool) for a in replica_apps(config))
