"""The cluster file's `image` (see docker/): each node's raylet runs inside it, so every replica and training worker
Ray places there runs in the image. `mlc-cli deploy nodes` prints, per raylet, the `docker run` line that starts it:
host networking (Ray's ports), the node's devices of that pool passed in (numbered from 0 inside), the `mounts`,
the training storage, `env`, and `ray start --block` through the image's `mlc-env`.

Ray's own `runtime_env={"image_uri": ...}` is not used: it needs podman on every node and starts workers with no
device or volume options of ours (Ray 2.60 mounts only its temp dir), so replicas could not reach their NPUs/GPUs
or the model store."""

from __future__ import annotations

import shlex
from pathlib import Path

from mlc.cluster.proxy_headers import ENV_VAR, IMPORT_PATH
from mlc.cluster.resources import DEFAULT_RAY_PORT, Raylet
from mlc.config.cluster_config import ClusterConfig

MODEL_STORE = "/mlc/models"  # MLC_HOME=/mlc in the images of docker/
# What the CANN container image's usage guide passes in besides the NPUs themselves: the driver stays on the host.
NPU_CONTROL_DEVICES = ("/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc")
NPU_DRIVER_MOUNTS = ("/usr/local/dcmi", "/usr/local/bin/npu-smi", "/usr/local/Ascend/driver/lib64/",
                     "/usr/local/Ascend/driver/version.info", "/etc/ascend_install.info")


def _target(mount: str) -> str:
    """The container path of a mount target that may end in docker's options (`/mlc/models:ro`)."""
    return mount.split(":", 1)[0]


def container_name(raylet: Raylet) -> str:
    """mlc-ray-inference / mlc-ray-training (a split node runs one of each), mlc-ray for a CPU node's both pools."""
    if len(raylet.pools) == 1:
        return "mlc-ray-" + next(iter(raylet.pools)).removeprefix("mlc_")
    return "mlc-ray"


def device_args(kind: str, devices: list[int]) -> list[str]:
    """The raylet's devices, passed into its container."""
    if kind == "cuda":
        return ["--gpus", '"device=' + ",".join(map(str, devices)) + '"']
    if kind == "npu":
        args = [a for i in devices for a in ("--device", f"/dev/davinci{i}")]
        args += [a for d in NPU_CONTROL_DEVICES for a in ("--device", d)]
        return args + [a for m in NPU_DRIVER_MOUNTS for a in ("-v", f"{m}:{m}:ro")]
    return []


def volumes(cluster: ClusterConfig, base_dir: Path) -> dict[str, str]:
    """host path -> container path: `mounts` (a relative host path is relative to the cluster file, like
    serve_config), plus training.storage at its own path when it is absolute and no mount covers it already."""
    out = {}
    for host, target in cluster.mounts.items():
        path = Path(host).expanduser()
        out[str(path if path.is_absolute() else (base_dir / path).resolve())] = target
    storage = cluster.training.storage
    covered = any(storage == t or storage.startswith(t.rstrip("/") + "/") for t in map(_target, out.values()))
    if storage.startswith("/") and not covered:
        out[storage] = storage
    return out


def docker_run(raylet: Raylet, cluster: ClusterConfig, kind: str, head_address: str, port: int = DEFAULT_RAY_PORT,
               base_dir: Path | None = None) -> str:
    """The shell line that starts `raylet` in the cluster's image on its node."""
    if cluster.image_ref is None:
        raise ValueError("the cluster config names no image")
    args = ["docker", "run", "-d", "--name", container_name(raylet), "--network=host", "--ipc=host",
            "--no-healthcheck", *device_args(kind, raylet.devices)]
    for host, target in volumes(cluster, base_dir or Path.cwd()).items():
        args += ["-v", f"{host}:{target}"]
    env = dict(cluster.env)
    if raylet.head:
        env[ENV_VAR] = IMPORT_PATH  # the visible-devices variable of a bare raylet is not needed: see device_args
    for key, value in env.items():
        args += ["-e", f"{key}={value}"]
    args += ["--entrypoint", "mlc-env", cluster.image_ref, "ray", *raylet.args(kind, head_address, port), "--block"]
    return " ".join(shlex.quote(a) for a in args)


def store_note(cluster: ClusterConfig) -> str | None:
    """A reminder when no mount gives the containers the model store (a store name resolves in MLC_HOME=/mlc)."""
    targets = {_target(t).rstrip("/") for t in cluster.mounts.values()}
    if Path(cluster.model).is_absolute() or targets & {MODEL_STORE, "/mlc"}:
        return None
    return (f"no mount puts a model store at {MODEL_STORE} (MLC_HOME=/mlc in the mlc images), so the replicas will not "
            f"find {cluster.model!r}; add e.g. `mounts: {{/data/mlc/models: {MODEL_STORE}}}` to the cluster file")
