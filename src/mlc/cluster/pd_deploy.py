"""Which Ray Serve applications of replicas a deployment runs: one (`mlc-replicas`, the inference pool) or, for a
prefill/decode layout (`pools: {prefill, decode}`, `pd:`), two: `mlc-prefill` on the prefill pool's devices and
`mlc-decode` on the decode pool's, as many replicas each as its devices hold.

The replicas of each pool run the deployment's serve config with their `kv_role` and the pool's engine overrides
(`pd.prefill` / `pd.decode`). The gateway sends a long prompt to a prefill replica first and its KV handle with the
request to a decode replica (`cluster/gateway.py`); the decode replica pulls the pages from the prefill replica's
side channel (`cluster/pd_side.py`), a small HTTP listener on that replica's node guarded by a token the deployment
shares with its replicas.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from mlc.config.cluster_config import ClusterConfig, Pool
from mlc.config.pd_config import PDConfig
from mlc.config.serve_config import ServeConfig

REPLICA_APP = "mlc-replicas"
REPLICA_DEPLOYMENT = "MlcReplica"
PREFILL_APP, PREFILL_DEPLOYMENT = "mlc-prefill", "MlcPrefill"
DECODE_APP, DECODE_DEPLOYMENT = "mlc-decode", "MlcDecode"
ALL_REPLICA_APPS = (REPLICA_APP, PREFILL_APP, DECODE_APP)


@dataclass(frozen=True)
class ReplicaApp:
    pool: Pool
    app: str
    deployment: str


def is_pd(cluster: ClusterConfig) -> bool:
    return cluster.pd is not None or "prefill" in (cluster.pools or {})


def replica_apps(cluster: ClusterConfig) -> list[ReplicaApp]:
    """The replica applications of this layout (prefill before decode)."""
    if is_pd(cluster):
        return [ReplicaApp("prefill", PREFILL_APP, PREFILL_DEPLOYMENT), ReplicaApp("decode", DECODE_APP,
                                                                                   DECODE_DEPLOYMENT)]
    return [ReplicaApp("inference", REPLICA_APP, REPLICA_DEPLOYMENT)]


def pool_spec(spec: dict, cluster: ClusterConfig, pool: Pool) -> dict:
    """A replica spec for `pool`: the inference pool's unchanged; a prefill or decode pool's with its role, its
    engine overrides and the layout's lease timeout."""
    if pool == "inference":
        return spec
    pd = cluster.pd or PDConfig()
    serve = ServeConfig(**spec["serve"])
    overrides = {k: v for k, v in getattr(pd, pool).model_dump().items() if v is not None}
    engine = serve.engine.model_copy(update={**overrides, "kv_lease_timeout": pd.kv_lease_timeout})
    role_config = serve.model_copy(update={"engine": engine, "kv_role": pool})
    return {**spec, "serve": role_config.model_dump(mode="json")}


def kv_token(cluster: ClusterConfig, previous: dict | None) -> str | None:
    """The side channel's shared token: kept across a roll (old prefill replicas serve new decode ones meanwhile)."""
    if not is_pd(cluster):
        return None
    return (previous or {}).get("kv_token") or secrets.token_hex(16)


def gateway_pd(cluster: ClusterConfig) -> dict | None:
    """What the gateway needs of the layout: the prompt size that goes to a prefill replica first."""
    return {"threshold_tokens": (cluster.pd or PDConfig()).threshold_tokens} if is_pd(cluster) else None
