"""What Ray must hold for a cluster config: the custom resources that keep the inference and training pools apart,
what one replica and one training worker ask for, and the `ray start` line of every node."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from mlc.config.cluster_config import ClusterConfig, Pool

POOL_RESOURCE: dict[str, str] = {"inference": "mlc_inference", "training": "mlc_training", "prefill": "mlc_prefill",
                                  "decode": "mlc_decode"}
ALL_POOLS: tuple[Pool, ...] = ("inference", "training", "prefill", "decode")
SERVING_POOLS: tuple[Pool, ...] = ("inference", "prefill", "decode")  # pools whose devices run replicas
VISIBLE_DEVICES = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}
DEFAULT_RAY_PORT = 6379


def device_kind(cluster: ClusterConfig) -> str:
    """cpu, cuda or npu: the hardware profile's device."""
    name = cluster.hardware
    if name == "cpu":
        return "cpu"
    from mlc.config.hardware import load_profile

    return load_profile(name).device


def accelerator_resources(kind: str, count: float) -> dict[str, float]:
    """Ray's name for `count` devices: GPU (num_gpus) on CUDA, the custom NPU resource on Ascend, none on CPU."""
    return {"GPU": count} if kind == "cuda" else {"NPU": count} if kind == "npu" else {}


def replica_devices(cluster: ClusterConfig) -> int:
    """Devices one serving replica holds: a tensor-parallel rank or a pipeline stage on each."""
    return cluster.tensor_parallel_size * cluster.pipeline_parallel_size


def replica_actor_options(cluster: ClusterConfig, kind: str, pool: Pool = "inference") -> dict:
    """Ray actor options of one serving replica: its CPUs, tensor_parallel_size x pipeline_parallel_size devices,
    and as many units of its pool's resource (inference, or prefill / decode), so that no replica lands on another
    pool's device."""
    devices = replica_devices(cluster)
    options = bundle_actor_options({"CPU": cluster.serving.cpus_per_replica, POOL_RESOURCE[pool]: devices,
                                    **accelerator_resources(kind, devices)})
    if cluster.env:
        options["runtime_env"] = {"env_vars": dict(cluster.env)}
    return options


def pool_replicas(cluster: ClusterConfig, pool: Pool) -> int:
    """Replicas a serving pool runs: data_parallel_size for `inference`; as many as its devices hold for the
    prefill and decode pools of a PD layout."""
    return cluster.replicas if pool == "inference" else cluster.pool_size(pool) // replica_devices(cluster)


def replica_bundles(cluster: ClusterConfig, kind: str) -> list[dict[str, float]] | None:
    """A pipeline-parallel replica's placement-group bundles, one per stage (a bundle lies on one node, so a stage's
    tensor-parallel ranks stay together): an equal share of the replica's CPUs, and `tensor_parallel_size` devices
    and units of the inference pool each. None without pipeline stages: the replica is one actor."""
    pp, tp = cluster.pipeline_parallel_size, cluster.tensor_parallel_size
    if pp == 1:
        return None
    bundle = {"CPU": cluster.serving.cpus_per_replica / pp, POOL_RESOURCE["inference"]: float(tp),
              **accelerator_resources(kind, tp)}
    return [dict(bundle) for _ in range(pp)]


def rank_share(bundle: dict[str, float], ranks: int) -> dict[str, float]:
    """What each of a stage's `ranks` processes takes of its bundle."""
    return {k: v / ranks for k, v in bundle.items()}


def bundle_actor_options(bundle: dict[str, float]) -> dict:
    """Ray actor options that take exactly `bundle` (Ray names CPUs and GPUs apart from custom resources)."""
    options: dict = {"num_cpus": bundle.get("CPU", 0.0),
                     "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}}
    if "GPU" in bundle:
        options["num_gpus"] = bundle["GPU"]
    return options


def worker_resources(cluster: ClusterConfig, kind: str) -> dict[str, float]:
    """What one Ray Train worker asks for: its CPUs, one device and one unit of the training pool resource."""
    return {"CPU": cluster.training.cpus_per_worker, POOL_RESOURCE["training"]: 1, **accelerator_resources(kind, 1)}


def needed(cluster: ClusterConfig, kind: str, pool: Pool) -> dict[str, float]:
    """Totals a serving pool's replicas (inference, prefill or decode) or the whole training job ask Ray for."""
    if pool in SERVING_POOLS:
        n, per = pool_replicas(cluster, pool), replica_devices(cluster)
        return {"CPU": n * cluster.serving.cpus_per_replica, POOL_RESOURCE[pool]: n * per,
                **accelerator_resources(kind, n * per)}
    n = cluster.training.workers
    return {k: v * n for k, v in worker_resources(cluster, kind).items()}


def shortfall(need: dict[str, float], have: dict[str, float]) -> list[str]:
    """Human lines for every resource the cluster has too little of."""
    return [f"{name}: needs {want:g}, the cluster has {have.get(name, 0):g}"
            for name, want in need.items() if have.get(name, 0) + 1e-9 < want]


@dataclass
class Raylet:
    """One `ray start` on one node: a node's devices of one pool (an accelerator node split between the pools runs
    two raylets, each seeing only its own devices), or all pools of a CPU node."""

    host: str
    pools: dict[str, int]  # pool resource name -> device count
    devices: list[int]
    head: bool = False

    def env(self, kind: str) -> dict[str, str]:
        from mlc.cluster.proxy_headers import ENV_VAR, IMPORT_PATH

        env = {VISIBLE_DEVICES[kind]: ",".join(map(str, self.devices))} if kind in VISIBLE_DEVICES else {}
        return {**env, ENV_VAR: IMPORT_PATH} if self.head else env

    def args(self, kind: str, head_address: str, port: int = DEFAULT_RAY_PORT) -> list[str]:
        resources = dict(self.pools)
        if kind == "npu":
            resources["NPU"] = len(self.devices)
        args = ["start", "--head", f"--port={port}"] if self.head else ["start", f"--address={head_address}"]
        if kind == "cuda":
            args.append(f"--num-gpus={len(self.devices)}")
        return args + [f"--resources={json.dumps(resources, sort_keys=True)}"]

    def command(self, kind: str, head_address: str, port: int = DEFAULT_RAY_PORT) -> str:
        """The shell line to run on `host`."""
        env = "".join(f"{k}={v} " for k, v in self.env(kind).items())
        return env + "ray " + " ".join(shlex.quote(a) for a in self.args(kind, head_address, port))


def raylets(cluster: ClusterConfig, kind: str) -> list[Raylet]:
    """The raylets the cluster needs, the head first (on the first node)."""
    out: list[Raylet] = []
    for node in cluster.nodes:
        by_pool = {POOL_RESOURCE[p]: cluster.pool_devices(p).get(node.host, []) for p in ALL_POOLS}
        by_pool = {name: ids for name, ids in by_pool.items() if ids}
        if not by_pool:
            continue
        if kind == "cpu":
            ids = sorted({i for ids in by_pool.values() for i in ids})
            out.append(Raylet(node.host, {name: len(ids) for name, ids in by_pool.items()}, ids))
        else:
            out += [Raylet(node.host, {name: len(ids)}, sorted(ids)) for name, ids in by_pool.items()]
    if out:
        out[0].head = True
    return out


def local_raylets(cluster: ClusterConfig, kind: str) -> list[Raylet]:
    """The raylets `ray_address: local` starts on this machine: those of the first node (the head first)."""
    return [r for r in raylets(cluster, kind) if r.host == cluster.nodes[0].host]


def check_local_devices(cluster: ClusterConfig, kind: str) -> None:
    """`ray_address: local` on an accelerator: the first node's device ids must exist on this machine."""
    import torch

    from mlc.config.device import npu_available
    from mlc.errors import ClusterError

    # torch_npu adds torch.npu; torch's stubs lack it
    npu_count = torch.npu.device_count() if kind != "cuda" and npu_available() else 0  # type: ignore[attr-defined]
    count = torch.cuda.device_count() if kind == "cuda" else npu_count
    host = cluster.nodes[0].host
    ids = sorted({i for p in ALL_POOLS for i in cluster.pool_devices(p).get(host, [])})
    if ids and ids[-1] >= count:
        raise ClusterError(f"the cluster config gives this machine ({host}) {kind} devices {ids}, but it has "
                           f"{count}; list only devices 0..{count - 1} in nodes/pools, "
                           "or run on the machine that has them")
