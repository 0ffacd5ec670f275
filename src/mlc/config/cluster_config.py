"""The cluster config (`mlc-cli deploy --cluster-config cluster.yaml`, `mlc-cli train --cluster-config ...`): the
Ray cluster's address, its nodes and devices, which of them serve and which train (`pools`), the replicas'
parallelism and resources, the training job's workers and storage, an optional image, env."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mlc.config.pd_config import PDConfig, check_pd_pools

# An image must be pinned: a dated tag (`:20240628`, `:20240628-cann8.0`) or a digest (`@sha256:<64 hex>`).
_DATED_TAG = re.compile(r":(20\d{6})([._-][\w.-]+)?$")
_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
_RAY_ADDRESS = re.compile(r"^(local(:\d{1,5})?|auto|ray://[\w.\-]+:\d{1,5}|[\w.\-]+:\d{1,5})$")
Pool = Literal["inference", "training", "prefill", "decode"]


def check_image_pin(image: str) -> str:
    if _DIGEST.search(image) or _DATED_TAG.search(image):
        return image
    tag = image.rsplit("/", 1)[-1].partition(":")[2]
    if not tag:
        raise ValueError(f"image {image!r} has no tag; pin it by date (e.g. {image}:20240628) or by @sha256 digest")
    if tag == "latest":
        raise ValueError("image tag 'latest' moves with every daily build; pin a dated tag such as :20240628")
    raise ValueError(f"image tag {tag!r} is not a date; pin a dated tag such as :20240628 or an @sha256 digest")


class NodeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str
    devices: list[int] | None = None  # device ids on this node; None -> 0..devices_per_node-1
    ssh_user: str | None = None


class PoolMember(BaseModel):
    """A node in a pool: all of its devices, or the listed ones."""

    model_config = ConfigDict(extra="forbid")

    host: str
    devices: list[int] | None = None


class ServingConfig(BaseModel):
    """How each Ray Serve replica asks for resources and how requests are routed to replicas."""

    model_config = ConfigDict(extra="forbid")

    cpus_per_replica: float = Field(1.0, gt=0)  # Ray CPUs; on CPU nodes also the engine's compute threads
    max_ongoing_requests: int = Field(64, ge=1)  # per replica; the replica's own --max-queue answers 429 past it
    routing: Literal["prefix_affinity", "power_of_two"] = "prefix_affinity"
    affinity_max_load_gap: int = Field(4, ge=0)  # prefix's replica busier than the least busy by more: go elsewhere
    affinity_chunk_chars: int = Field(64, ge=8)  # prefix granularity in characters (about one KV page of tokens)
    health_check_period_s: float = Field(5.0, gt=0)
    startup_timeout_s: float = Field(900.0, gt=0)  # loading the model on every replica, per deploy


class TrainingConfig(BaseModel):
    """The Ray Train job of `mlc-cli train --cluster-config`: DDP workers on the training pool."""

    model_config = ConfigDict(extra="forbid")

    config: str | None = None  # the lora.yaml to train with (else `--config`, else the defaults)
    workers: int = Field(2, ge=1)  # DDP ranks, one training device each
    cpus_per_worker: float = Field(1.0, gt=0)
    storage: str = "~/mlc-runs"  # checkpoints and adapters; a directory every training node mounts (NFS...)
    max_failures: int = Field(3, ge=0)  # worker-group restarts (from the last checkpoint) before the run fails


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str
    hardware: str = "ascend-910b"  # a profile name (`mlc-cli plan --hardware`) or a profile .yaml path
    ray_address: str = "local"  # local[:port]: start a Ray head here; auto; host:port; ray://host:port
    nodes: list[NodeConfig] = Field(min_length=1)
    devices_per_node: int = Field(8, ge=1)
    pools: dict[Pool, list[PoolMember]] | None = None  # None: every device serves, none trains
    tensor_parallel_size: int = Field(1, ge=1)  # devices per replica
    data_parallel_size: int = Field(1, ge=1)  # replicas
    pipeline_parallel_size: int = Field(1, ge=1)
    image: str | None = None  # the image each node runs `ray start` in (see docker/)
    image_sha256: str | None = None  # digest to verify the pulled image against
    serve_config: str | None = None  # path of the serve.yaml each replica runs with
    host: str = "127.0.0.1"  # where the one HTTP endpoint listens (on the head node); 0.0.0.0 for other machines
    port: int = Field(8080, ge=1, le=65535)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    pd: PDConfig | None = None  # prefill/decode layout (with pools.prefill and pools.decode; config/pd_config.py)
    env: dict[str, str] = {}
    mounts: dict[str, str] = {}  # host path -> container path, for the nodes' containers when `image` is set

    @field_validator("nodes", mode="before")
    @classmethod
    def _hosts(cls, v):
        return [{"host": n} if isinstance(n, str) else n for n in v] if isinstance(v, list) else v

    @field_validator("pools", mode="before")
    @classmethod
    def _pool_hosts(cls, v):
        if isinstance(v, dict):
            return {k: cls._hosts(m) if isinstance(m, list) else m for k, m in v.items()}
        return v

    @field_validator("ray_address")
    @classmethod
    def _address(cls, v: str) -> str:
        if not _RAY_ADDRESS.match(v):
            raise ValueError("use local (start a Ray head here), local:PORT, auto, HOST:PORT (e.g. 10.0.0.1:6379) "
                             "or ray://HOST:PORT")
        return v

    @field_validator("image")
    @classmethod
    def _pinned(cls, v: str | None) -> str | None:
        return None if v is None else check_image_pin(v)

    @field_validator("image_sha256")
    @classmethod
    def _digest(cls, v: str | None):
        if v is not None and not re.fullmatch(r"(sha256:)?[0-9a-f]{64}", v):
            raise ValueError("image_sha256 must be 64 hex digits, optionally prefixed by 'sha256:'")
        return v

    @field_validator("mounts")
    @classmethod
    def _mount_targets(cls, v: dict[str, str]) -> dict[str, str]:
        for host, target in v.items():
            if not target.startswith("/"):
                raise ValueError(f"mounts: container path {target!r} (for {host!r}) must be absolute, e.g. "
                                 "/mlc/models, where the mlc images keep the model store")
        return v

    @model_validator(mode="after")
    def _image_digest(self):
        if self.image_sha256 is not None and self.image is None:
            raise ValueError("image_sha256 pins `image`, which is not set; set image (e.g. mlc:20260920-cuda) or "
                             "remove image_sha256")
        if self.image_sha256 is not None and self.image is not None and "@sha256:" in self.image:
            given = self.image_sha256.removeprefix("sha256:")
            if self.image.rpartition("@sha256:")[2] != given:
                raise ValueError("image names a digest and image_sha256 another; keep one of them")
        return self

    @property
    def image_ref(self) -> str | None:
        """`image` as `docker run` pulls it: with image_sha256 appended as @sha256:..., so the pull is verified."""
        if self.image is None or self.image_sha256 is None or "@sha256:" in self.image:
            return self.image
        return f"{self.image}@sha256:{self.image_sha256.removeprefix('sha256:')}"

    @field_validator("env", mode="before")
    @classmethod
    def _env_strings(cls, v):
        # YAML reads HCCL_WHITELIST_DISABLE: 1 as an int; the environment only holds strings.
        if isinstance(v, dict):
            return {str(k): ("1" if x is True else "0" if x is False else str(x)) for k, x in v.items()}
        return v

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size * self.pipeline_parallel_size

    @property
    def replicas(self) -> int:
        return self.data_parallel_size

    def devices_on(self, node: NodeConfig) -> list[int]:
        return node.devices if node.devices is not None else list(range(self.devices_per_node))

    @property
    def total_devices(self) -> int:
        return sum(len(self.devices_on(n)) for n in self.nodes)

    def node(self, host: str) -> NodeConfig:
        return next(n for n in self.nodes if n.host == host)

    def pool_devices(self, pool: Pool) -> dict[str, list[int]]:
        """host -> the device ids of `pool` on it (hosts without any left out)."""
        if self.pools is None:
            return {n.host: self.devices_on(n) for n in self.nodes} if pool == "inference" else {}
        out: dict[str, list[int]] = {}
        for m in self.pools.get(pool, []):
            ids = m.devices if m.devices is not None else self.devices_on(self.node(m.host))
            out.setdefault(m.host, []).extend(ids)
        return out

    def pool_size(self, pool: Pool) -> int:
        return sum(len(ids) for ids in self.pool_devices(pool).values())

    @model_validator(mode="after")
    def _fits(self):
        hosts = [n.host for n in self.nodes]
        dupes = sorted({h for h in hosts if hosts.count(h) > 1})
        if dupes:
            raise ValueError(f"node(s) listed twice: {', '.join(dupes)}")
        self._check_pools()
        if self.pd is not None or (self.pools and ("prefill" in self.pools or "decode" in self.pools)):
            check_pd_pools({p: self.pool_size(p) for p in (self.pools or {})}, self.pd,
                           self.tensor_parallel_size * self.pipeline_parallel_size)
            return self
        serving = self.pool_devices("inference")
        if self.world_size > self.pool_size("inference"):
            where = "the inference pool has" if self.pools is not None else "the nodes have"
            raise ValueError(
                f"tensor x data x pipeline parallel = {self.world_size} devices, but {where} "
                f"{self.pool_size('inference')}; lower a parallel size or add nodes"
            )
        if self.tensor_parallel_size > max((len(ids) for ids in serving.values()), default=0):
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} spans nodes (the most inference devices on one "
                "node is fewer); keep tensor parallelism inside one node and use data parallelism across nodes"
            )
        if self.pools is not None and "training" in self.pools and self.training.workers > self.pool_size("training"):
            raise ValueError(f"training.workers {self.training.workers} exceeds the training pool's "
                             f"{self.pool_size('training')} devices; lower training.workers or add training devices")
        return self

    def _check_pools(self) -> None:
        if self.pools is None:
            return
        known = {n.host: set(self.devices_on(n)) for n in self.nodes}
        taken: dict[tuple[str, int], str] = {}
        for pool, members in self.pools.items():
            for m in members:
                if m.host not in known:
                    raise ValueError(f"pools.{pool}: host {m.host!r} is not one of the nodes ({', '.join(known)})")
                ids = m.devices if m.devices is not None else sorted(known[m.host])
                missing = sorted(set(ids) - known[m.host])
                if missing:
                    raise ValueError(f"pools.{pool}: {m.host} has no device(s) {missing} (its devices: "
                                     f"{sorted(known[m.host])})")
                for i in ids:
                    other = taken.get((m.host, i))
                    if other == pool:
                        raise ValueError(f"pools.{pool}: device {i} of {m.host} is listed twice")
                    if other is not None:
                        raise ValueError(f"device {i} of {m.host} is in both pools ({other} and {pool}); "
                                         "a device either serves or trains, never both")
                    taken[(m.host, i)] = pool
