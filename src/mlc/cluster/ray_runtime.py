"""Reaching the Ray cluster a config names: `ray` installed (the `mlc[cluster]` extra), the address reachable, a head
started here for `ray_address: local` (and stopped again by `deploy down`), and enough resources for a job."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlc.cluster.resources import DEFAULT_RAY_PORT, local_raylets, shortfall
from mlc.config.cluster_config import ClusterConfig
from mlc.config.paths import mlc_home
from mlc.errors import ClusterError

NAMESPACE = "mlc"
INSTALL_HINT = "pip install 'mlc[cluster]' (or: pip install 'ray[serve,train]')"
HEAD_START_TIMEOUT_S = 120.0
LOOPBACK = "127.0.0.1"
# Ray turns a loopback --node-ip-address into the machine's routable address unless its cluster mode is off (its
# local-only mode on macOS and Windows); a local head sets it so that nothing it starts listens beyond loopback.
LOCAL_ONLY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def require_ray(what: str = "this command") -> None:
    """ClusterError with the install line when Ray (with Serve and Train) is not importable."""
    try:
        import ray
        import ray.serve
        import ray.train  # noqa: F401 (imported to see that it is installed)
    except ImportError as e:
        raise ClusterError(f"{what} runs on Ray, which is not installed ({e.name or e}); install it with: "
                           f"{INSTALL_HINT}") from None


@dataclass
class Address:
    """Where the cluster's head is: `local` (a head this machine runs, started on demand) or a remote one."""

    text: str  # what ray.init gets
    local_port: int | None = None  # set for `local`

    @property
    def is_local(self) -> bool:
        return self.local_port is not None

    @property
    def on_loopback(self) -> bool:
        """A head on this machine's loopback: `local`, or one started by hand with --node-ip-address=127.0.0.1."""
        import ipaddress

        if self.is_local:
            return True
        hp = _host_port(self.text)
        if hp is None:
            return False
        try:
            return hp[0] == "localhost" or ipaddress.ip_address(hp[0]).is_loopback
        except ValueError:
            return False


def parse_address(cluster: ClusterConfig) -> Address:
    value = cluster.ray_address
    if value.startswith("local"):
        port = int(value.partition(":")[2] or DEFAULT_RAY_PORT)
        return Address(f"{LOOPBACK}:{port}", port)
    return Address(value)


def _host_port(address: str) -> tuple[str, int] | None:
    rest = address.removeprefix("ray://")
    host, _, port = rest.rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def reachable(address: str, timeout_s: float = 3.0) -> bool:
    hp = _host_port(address)
    if hp is None:
        return True  # `auto`: ray.init finds the running cluster itself
    try:
        with socket.create_connection(hp, timeout=timeout_s):
            return True
    except OSError:
        return False


# a head on this machine
def _state_dir() -> Path:
    return mlc_home() / "cluster"


def head_record_path(port: int) -> Path:
    return _state_dir() / f"local-head-{port}.json"


def _ray_executable() -> str:
    beside = Path(sys.executable).with_name("ray")
    found = str(beside) if beside.is_file() else shutil.which("ray")
    if not found:
        raise ClusterError(f"the `ray` command is not on PATH; install Ray with: {INSTALL_HINT}")
    return found


def start_local_head(cluster: ClusterConfig, kind: str, port: int) -> list[int]:
    """Start the first node's raylets here (`ray start --block`, one per pool on an accelerator node split
    between pools), each in its own session so that it outlives this command. Returns their process ids."""
    log_path = _state_dir() / f"local-head-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    pids: list[int] = []
    address = f"{LOOPBACK}:{port}"
    try:
        for raylet in local_raylets(cluster, kind):
            # a local head is a trial on one machine: its GCS, raylets and object transfers stay on loopback
            args = [*raylet.args(kind, address, port), "--block", "--disable-usage-stats",
                    f"--node-ip-address={LOOPBACK}"]
            if raylet.head:
                args.append("--include-dashboard=false")
            with log_path.open("ab") as log:
                proc = subprocess.Popen([_ray_executable(), *args], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                        env={**os.environ, **LOCAL_ONLY_ENV, **raylet.env(kind)},
                                        start_new_session=True)
            pids.append(proc.pid)
            _wait_head(proc, address, log_path) if raylet.head else time.sleep(1.0)
    except BaseException:
        stop_pids(pids)
        raise
    head_record_path(port).write_text(json.dumps({"pids": pids, "address": address, "log": str(log_path)}))
    return pids


def _wait_head(proc: subprocess.Popen, address: str, log_path: Path) -> None:
    deadline = time.monotonic() + HEAD_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ClusterError(f"the local Ray head exited (code {proc.returncode}); its log is {log_path}")
        if reachable(address, 0.5):
            return
        time.sleep(0.5)
    raise ClusterError(f"the local Ray head did not come up within {HEAD_START_TIMEOUT_S:.0f}s; see {log_path}")


def stop_pids(pids: list[int], timeout_s: float = 30.0) -> None:
    """SIGTERM each `ray start --block` (it stops the Ray processes it started), SIGKILL what outlives the timeout."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.2)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)  # our own child: reap it
        if waited == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_local_head(port: int) -> bool:
    """Stop the head `deploy` started here on `port`; False when there is none."""
    record = head_record_path(port)
    if not record.is_file():
        return False
    stop_pids(json.loads(record.read_text())["pids"])
    record.unlink(missing_ok=True)
    return True


# connecting
@dataclass
class Connection:
    address: Address
    started_here: bool  # this call started the local head: undo it if the job cannot start


def connect(cluster: ClusterConfig, kind: str, start: bool = True) -> Connection:
    """ray.init against the config's cluster; `local` starts a head here when none runs (unless `start` is off)."""
    require_ray()
    import ray

    address = parse_address(cluster)
    started = False
    if not reachable(address.text):
        if address.local_port is None:
            raise ClusterError(f"cannot reach the Ray cluster at {cluster.ray_address} (nothing answers there); start "
                               "it with `ray start --head` on the head node (see `mlc-cli deploy nodes`), or fix "
                               "ray_address in the cluster config")
        if not start:
            raise ClusterError(f"no local Ray head runs on port {address.local_port}; nothing is deployed here")
        start_local_head(cluster, kind, address.local_port)
        started = True
    if not ray.is_initialized():
        logging.getLogger("ray").setLevel(logging.WARNING)
        try:
            node_ip: dict[str, Any] = {}  # ray.init takes it through **kwargs
            if address.on_loopback:  # this driver, too, on the head's loopback
                _local_only(ray)
                node_ip = {"_node_ip_address": LOOPBACK}
            ray.init(address=address.text, namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=False,
                     **node_ip)
            logging.getLogger("ray.serve").setLevel(logging.WARNING)  # Serve's own INFO lines are not ours to print
        except (ConnectionError, RuntimeError) as e:
            if started and address.local_port is not None:
                stop_local_head(address.local_port)
            raise ClusterError(f"cannot connect to the Ray cluster at {cluster.ray_address}: {e}") from None
    return Connection(address, started)


def _local_only(ray) -> None:
    """Ray's local-only mode in this process: set for the workers it starts, and read by the Ray already imported
    here (it reads the variable once, at import; otherwise it would dial the head at the machine's address)."""
    os.environ.update(LOCAL_ONLY_ENV)
    constants = getattr(getattr(ray, "_private", None), "ray_constants", None)
    if constants is not None and hasattr(constants, "ENABLE_RAY_CLUSTER"):
        constants.ENABLE_RAY_CLUSTER = False


def undo(conn: Connection) -> None:
    """Leave nothing half-started: disconnect, and stop the local head if this command started it."""
    import ray

    ray.shutdown()
    if conn.started_here and conn.address.local_port is not None:
        stop_local_head(conn.address.local_port)


def check_resources(need: dict[str, float], what: str) -> None:
    """ClusterError listing what the cluster lacks for `need` (totals over its nodes)."""
    import ray

    missing = shortfall(need, ray.cluster_resources())
    if missing:
        raise ClusterError(f"the cluster cannot hold {what}: " + "; ".join(missing) + ". Add nodes (see `mlc-cli "
                           "deploy nodes`), label more devices for this pool in `pools`, or ask for less")
