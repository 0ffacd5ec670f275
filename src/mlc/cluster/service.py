"""`mlc-cli deploy`: the replicas (Ray Serve app `mlc-replicas`) and the one endpoint in front of them (app `mlc`),
deployed or rolled over, then `deploy down`.

Two Serve applications, so that rolling the replicas onto a new model or adapter never touches the gateway: Serve
replaces them one at a time, starting each new one only after an old one has drained its requests, while the
router sends new requests to the replicas still up. A roll that fails puts the previous replicas back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mlc.cluster import ray_runtime
from mlc.cluster.pd_deploy import (
    ALL_REPLICA_APPS,
    ReplicaApp,
    gateway_pd,
    is_pd,
    kv_token,
    pool_spec,
    replica_apps,
)
from mlc.cluster.resources import (
    bundle_actor_options,
    device_kind,
    needed,
    pool_replicas,
    rank_share,
    replica_actor_options,
    replica_bundles,
)
from mlc.config.cluster_config import ClusterConfig
from mlc.config.serve_config import ServeConfig
from mlc.errors import ClusterError

Progress = Callable[[str], None]
POLL_S = 1.0


@dataclass
class DeployResult:
    endpoint: str
    model: str
    adapters: list[str]
    replicas: int
    generation: int
    rolled: bool  # replaced a running deployment
    seconds_to_healthy: float
    started_head: bool
    notes: list[str] = field(default_factory=list)


def replica_serve_config(cluster: ClusterConfig, serve: ServeConfig, kind: str) -> ServeConfig:
    """The serve config every replica runs: the device of the pool's kind, CPU threads matching its CPUs."""
    tp, pp = cluster.tensor_parallel_size, cluster.pipeline_parallel_size
    engine = serve.engine.model_copy(update={
        "device": kind if serve.engine.device in ("cpu", "auto") else serve.engine.device,
        # each tensor-parallel rank (or pipeline stage) of the replica gets its share of the replica's CPUs
        "num_threads": serve.engine.num_threads or (max(1, int(cluster.serving.cpus_per_replica) // (tp * pp))
                                                    if kind == "cpu" else None),
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
    })
    return serve.model_copy(update={"engine": engine})


def _replica_app(cluster: ClusterConfig, spec: dict, kind: str, app: ReplicaApp):
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from mlc.cluster.replica import ReplicaServer
    from mlc.cluster.router import PrefixAffinityRouter

    s = cluster.serving
    options = dict(
        name=app.deployment, num_replicas=pool_replicas(cluster, app.pool), max_ongoing_requests=s.max_ongoing_requests,
        ray_actor_options=replica_actor_options(cluster, kind, app.pool), health_check_period_s=s.health_check_period_s,
        health_check_timeout_s=max(30.0, 2 * s.health_check_period_s),
        graceful_shutdown_timeout_s=spec["serve"]["shutdown_grace_s"], graceful_shutdown_wait_loop_s=0.5,
    )
    spec = pool_spec(spec, cluster, app.pool)
    bundles = replica_bundles(cluster, kind)
    if bundles is not None:
        # one bundle a pipeline stage, the replica itself (stage 0) in the first; PACK: one node when one holds the
        # stages, else as few nodes as it takes (cluster/stage_hosts.py)
        tp = cluster.tensor_parallel_size
        options.update(placement_group_bundles=bundles, placement_group_strategy="PACK", ray_actor_options={
            **options["ray_actor_options"], **bundle_actor_options(rank_share(bundles[0], tp))})
        spec = {**spec, "stage_bundles": bundles, "ranks_per_stage": tp}
    if s.routing == "prefix_affinity":
        options["request_router_config"] = RequestRouterConfig(  # Ray annotates its **kwargs as dicts
            request_router_class=PrefixAffinityRouter,  # type: ignore[arg-type]
            request_router_kwargs={"max_load_gap": s.affinity_max_load_gap})
    # serve.deployment(cls) returns a Deployment; Ray annotates it as always returning the decorator
    deployment = serve.deployment(ReplicaServer, **one_at_a_time())
    return deployment.options(**options).bind(spec)  # type: ignore[attr-defined]


def run_replica_apps(cluster: ClusterConfig, spec: dict, kind: str, progress: Progress) -> None:
    """Deploy (or roll) every replica application of the layout, then wait until each runs."""
    from ray import serve

    apps = replica_apps(cluster)
    for app in apps:
        serve._run(_replica_app(cluster, spec, kind, app), _blocking=False, name=app.app, route_prefix=None)
    for app in apps:
        wait_running(app.app, cluster.serving.startup_timeout_s, progress)


def drop_other_layout(cluster: ClusterConfig) -> None:
    """After a roll from the other layout (plain replicas <-> prefill/decode) has its gateway: the old replicas go."""
    from ray import serve

    for name in set(ALL_REPLICA_APPS) - {a.app for a in replica_apps(cluster)}:
        if name in serve.status().applications:
            serve.delete(name)


def one_at_a_time() -> dict:
    """Serve's own rolling update replaces 20% of the replicas at a time (at least one); this asks for exactly one,
    where this Ray version has the option (2.5x and later: `rolling_update_percentage`, rounded down, at least 1)."""
    import inspect

    from ray import serve

    if "rolling_update_percentage" in inspect.signature(serve.deployment).parameters:
        return {"rolling_update_percentage": 1e-6}
    return {}


def _gateway_app(spec: dict):
    from ray import serve

    from mlc.cluster.gateway import GATEWAY_DEPLOYMENT, Gateway

    # serve.deployment(cls) returns a Deployment; Ray annotates it as always returning the decorator
    return serve.deployment(Gateway).options(  # type: ignore[attr-defined]
        name=GATEWAY_DEPLOYMENT, num_replicas=1, max_ongoing_requests=10_000,
        ray_actor_options={"num_cpus": 0}).bind(spec)


def wait_running(app: str, timeout_s: float, progress: Progress) -> None:
    """Until Serve reports `app` RUNNING; ClusterError with Serve's own explanation when it fails or times out."""
    from ray import serve

    deadline, last = time.monotonic() + timeout_s, ""
    while True:
        status = serve.status().applications.get(app)
        if status is not None and status.status == "RUNNING":
            return
        message = _explain(status)
        if status is not None and status.status == "DEPLOY_FAILED":
            raise ClusterError(f"the replicas did not start: {message}")
        if message and message != last:
            progress(message)
            last = message
        if time.monotonic() > deadline:
            raise ClusterError(f"the deployment was not running after {timeout_s:.0f}s (serving.startup_timeout_s): "
                               f"{message or 'no status from Ray Serve'}")
        time.sleep(POLL_S)


def _explain(status) -> str:
    if status is None:
        return ""
    parts = [status.message] if status.message else []
    for name, d in status.deployments.items():
        states = ", ".join(f"{n} {s.lower()}" for s, n in d.replica_states.items())
        parts.append(f"{name}: {d.status.lower()}" + (f" ({states})" if states else "") +
                     (f": {d.message.strip().splitlines()[-1]}" if d.message else ""))
    return "; ".join(parts)


def wait_endpoint(url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ClusterError(f"{url}/health did not answer 200 within {timeout_s:.0f}s of the replicas running")


def deploy(cluster: ClusterConfig, serve_cfg: ServeConfig, hooks: dict | None = None,
           progress: Progress = lambda _: None) -> DeployResult:
    """Deploy, or roll the running deployment over to `serve_cfg` (a new model or adapters) one replica at a time."""
    import ray
    from ray import serve

    from mlc.cluster.gateway import GATEWAY_APP
    from mlc.cluster.registry import get_registry

    kind = device_kind(cluster)
    notes = _preflight(cluster, kind)
    t0 = time.monotonic()
    conn = ray_runtime.connect(cluster, kind)
    if conn.started_here:
        progress(f"started a Ray head on this machine ({conn.address.text})")
    registry = previous = None
    try:
        for app in replica_apps(cluster):
            where = "" if app.pool == "inference" else f" of the {app.pool} pool"
            ray_runtime.check_resources(needed(cluster, kind, app.pool),
                                        f"{pool_replicas(cluster, app.pool)} replica(s){where}")
        serve.start(http_options={"host": cluster.host, "port": cluster.port}, proxy_location="HeadOnly")
        registry = get_registry(create=True)
        previous = ray.get(registry.spec.remote())
        config = replica_serve_config(cluster, serve_cfg, kind)
        spec = {"serve": config.model_dump(mode="json"), "hooks": hooks or {},
                "generation": (previous or {}).get("generation", 0) + 1, "push_s": 1.0,
                "kv_token": kv_token(cluster, previous)}
        counts = ", ".join(f"{pool_replicas(cluster, a.pool)} {a.pool}" for a in replica_apps(cluster))
        progress(f"{'rolling' if previous else 'starting'} replicas ({counts}) of {config.engine.model}")
        run_replica_apps(cluster, spec, kind, progress)
        gateway_spec = {"chunk_chars": cluster.serving.affinity_chunk_chars, "api_keys": config.api_keys,
                        "request_timeout_s": config.request_timeout_s, "pd": gateway_pd(cluster)}
        if (previous is None or previous.get("gateway") != gateway_spec
                or GATEWAY_APP not in serve.status().applications):
            serve._run(_gateway_app(gateway_spec), _blocking=False, name=GATEWAY_APP, route_prefix="/")
            wait_running(GATEWAY_APP, 120.0, progress)
        drop_other_layout(cluster)
        endpoint = f"http://{'127.0.0.1' if cluster.host in ('0.0.0.0', '::') else cluster.host}:{cluster.port}"
        wait_endpoint(endpoint, 60.0)
        ray.get(registry.set_spec.remote({**spec, "gateway": gateway_spec, "cluster": cluster.model_dump(mode="json")}))
    except BaseException as e:
        _recover(cluster, kind, conn, registry, previous, progress)
        if isinstance(e, (ClusterError, KeyboardInterrupt)):
            raise
        raise ClusterError(f"deploy failed: {type(e).__name__}: {e}") from e
    return DeployResult(
        endpoint=endpoint, model=config.engine.model, adapters=sorted(config.engine.lora_adapters),
        replicas=sum(pool_replicas(cluster, a.pool) for a in replica_apps(cluster)), generation=spec["generation"],
        rolled=previous is not None,
        seconds_to_healthy=time.monotonic() - t0, started_head=conn.started_here, notes=notes)


def _preflight(cluster: ClusterConfig, kind: str) -> list[str]:
    """Problems found before anything starts (ClusterError), and notes for the user."""
    notes = []
    pp = cluster.pipeline_parallel_size
    if is_pd(cluster) and cluster.tensor_parallel_size * pp > 1:
        raise ClusterError("a prefill/decode layout moves one process's KV pages, and its instances run one process "
                           "each: set tensor_parallel_size and pipeline_parallel_size to 1 (or serve without pools "
                           "prefill/decode)")
    if pp > 1:
        notes.append(stage_note(cluster))
    if cluster.tensor_parallel_size > 1:
        notes.append(f"each replica holds {cluster.tensor_parallel_size} devices of one node (Ray places an actor's "
                     "resources together) and runs one tensor-parallel rank on each")
    if ray_runtime.parse_address(cluster).is_local and kind != "cpu":
        from mlc.cluster.resources import check_local_devices

        check_local_devices(cluster, kind)
    return notes


def stage_note(cluster: ClusterConfig) -> str:
    """Where a pipeline-parallel replica's stages go; ClusterError when the nodes cannot hold every replica's stage
    bundles (tensor_parallel_size devices of one node each), which Ray would otherwise wait for forever."""
    pp, tp = cluster.pipeline_parallel_size, cluster.tensor_parallel_size
    per_node = [len(ids) for ids in cluster.pool_devices("inference").values()]
    holds = sum(n // tp for n in per_node)  # stage bundles the nodes hold
    if holds < pp * cluster.replicas:
        raise ClusterError(f"{cluster.replicas} replica(s) of {pp} pipeline stages need {pp * cluster.replicas} "
                           f"groups of {tp} inference devices on one node, and the nodes hold {holds} "
                           f"({', '.join(map(str, per_node))} devices); lower pipeline_parallel_size or "
                           "data_parallel_size, or give the nodes devices in multiples of tensor_parallel_size")
    most = max(per_node, default=tp)
    fit = most // tp  # stages a node holds
    where = "one node" if pp <= fit else f"{-(-pp // fit)} nodes or more (at most {fit} stages a node)"
    each = f"{tp} devices of one node" if tp > 1 else "one device"
    return (f"each replica runs {pp} pipeline stages, {each} each, in a Ray placement group: on {where}; every "
            "node that holds a stage needs the model at the same path (or in its model store)")


def _recover(cluster, kind, conn, registry, previous, progress: Progress) -> None:
    """Nothing half-started: a failed first deploy is removed (and a head it started stopped); a failed roll puts
    the previous replicas back."""
    from ray import serve

    from mlc.cluster.gateway import GATEWAY_APP

    try:
        if previous is not None:
            progress("the new replicas failed: putting the previous ones back")
            old = ClusterConfig(**previous["cluster"])
            run_replica_apps(old, previous, kind, progress)
            if previous.get("gateway") is not None:  # it may have been rolled onto the new layout already
                serve._run(_gateway_app(previous["gateway"]), _blocking=False, name=GATEWAY_APP, route_prefix="/")
            drop_other_layout(old)
            return
        for app in (GATEWAY_APP, *ALL_REPLICA_APPS):
            if app in serve.status().applications:
                serve.delete(app)
        if registry is not None:
            import ray

            ray.kill(registry)
    except Exception as e:  # the cluster itself is failing: report the original error, not this one
        progress(f"cleaning up after the failure also failed: {e}")
    finally:
        if previous is None:
            ray_runtime.undo(conn)


def down(cluster: ClusterConfig) -> list[str]:
    """Remove the deployment; stop the local head `deploy` started. Returns what was done."""
    import ray
    from ray import serve

    from mlc.cluster.gateway import GATEWAY_APP
    from mlc.cluster.registry import get_registry

    address = ray_runtime.parse_address(cluster)
    done: list[str] = []
    if ray_runtime.reachable(address.text):
        ray_runtime.connect(cluster, device_kind(cluster), start=False)
        apps = serve.status().applications
        for app in (GATEWAY_APP, *ALL_REPLICA_APPS):
            if app in apps:
                serve.delete(app)
                done.append(f"deleted Serve application {app}")
        if not set(serve.status().applications) - {GATEWAY_APP, *ALL_REPLICA_APPS}:
            serve.shutdown()
        registry = get_registry()
        if registry is not None:
            ray.kill(registry)
        ray.shutdown()
    if address.local_port is not None and ray_runtime.stop_local_head(address.local_port):
        done.append(f"stopped the local Ray head on port {address.local_port}")
    return done or ["nothing was deployed"]


def resolve_paths(serve_cfg: ServeConfig, base: Path) -> ServeConfig:
    """Local paths (model dir, adapters, audit log) made absolute: replicas do not run in this directory."""
    def fix(value: str) -> str:
        p = Path(value).expanduser()
        return str((base / p).resolve()) if not p.is_absolute() and (base / p).exists() else value

    engine = serve_cfg.engine.model_copy(update={
        "model": fix(serve_cfg.engine.model),
        "lora_adapters": {k: fix(v) for k, v in serve_cfg.engine.lora_adapters.items()}})
    audit = str(Path(serve_cfg.audit_log).expanduser().resolve()) if serve_cfg.audit_log else None
    return serve_cfg.model_copy(update={"engine": engine, "audit_log": audit})
