"""The cluster config (`mlc-cli deploy --cluster-config cluster.yaml`): nodes, devices, parallelism, image, env."""

from __future__ import annotations

import re
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# An image must be pinned: a dated tag (`:20240628`, `:20240628-cann8.0`) or a digest (`@sha256:<64 hex>`).
_DATED_TAG = re.compile(r":(20\d{6})([._-][\w.-]+)?$")
_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


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


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str
    hardware: str = "ascend-910b"  # a profile name (`mlc-cli plan --hardware`) or a profile .yaml path
    nodes: list[NodeConfig] = Field(min_length=1)
    devices_per_node: int = Field(8, ge=1)
    tensor_parallel_size: int = Field(1, ge=1)
    data_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    image: str
    image_sha256: str | None = None  # digest to verify the pulled image against
    serve_config: str | None = None  # path of the serve.yaml each replica runs with
    port: int = Field(8080, ge=1, le=65535)
    env: dict[str, str] = {}
    mounts: dict[str, str] = {}  # host path -> container path

    @field_validator("nodes", mode="before")
    @classmethod
    def _hosts(cls, v):
        return [{"host": n} if isinstance(n, str) else n for n in v] if isinstance(v, list) else v

    @field_validator("image")
    @classmethod
    def _pinned(cls, v: str) -> str:
        return check_image_pin(v)

    @field_validator("image_sha256")
    @classmethod
    def _digest(cls, v: str | None):
        if v is not None and not re.fullmatch(r"(sha256:)?[0-9a-f]{64}", v):
            raise ValueError("image_sha256 must be 64 hex digits, optionally prefixed by 'sha256:'")
        return v

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

    def devices_on(self, node: NodeConfig) -> list[int]:
        return node.devices if node.devices is not None else list(range(self.devices_per_node))

    @property
    def total_devices(self) -> int:
        return sum(len(self.devices_on(n)) for n in self.nodes)

    @model_validator(mode="after")
    def _fits(self):
        if self.world_size > self.total_devices:
            raise ValueError(
                f"tensor x data x pipeline parallel = {self.world_size} devices, but the nodes have "
                f"{self.total_devices}; lower a parallel size or add nodes"
            )
        if self.tensor_parallel_size > self.devices_per_node:
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} spans nodes (devices_per_node "
                f"{self.devices_per_node}); keep tensor parallelism inside one node and use data parallelism across nodes"
            )
        hosts = [n.host for n in self.nodes]
        dupes = sorted({h for h in hosts if hosts.count(h) > 1})
        if dupes:
            raise ValueError(f"node(s) listed twice: {', '.join(dupes)}")
        return self
