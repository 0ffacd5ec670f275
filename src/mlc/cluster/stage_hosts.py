"""A serving replica's pipeline stages on the nodes of its Ray placement group.

A replica with `pipeline_parallel_size` P > 1 is deployed with one bundle per stage (`resources.replica_bundles`:
the stage's CPUs, its device, one unit of the inference pool) and Ray's PACK strategy: all stages on one node when
one node holds them, otherwise over as few nodes as it takes. The replica itself (stage 0: the embedding, the
scheduler, the sampler) runs in bundle 0. Stage r runs in bundle r: a small actor there (`StageHost`) starts the
same worker process a one-node engine starts (`python -m mlc.engine.pp_worker`) on its own node, with that node's
Python and environment, and answers for it (poll, wait, kill). The stage dials back to the replica's node address;
the hidden states then flow stage to stage over torch.distributed as on one node (gloo on CPUs; name the interface
with GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME in the cluster config's `env` where nodes have several).

The actors are the replica's own: when the replica goes, Ray ends them, and a stage whose host is gone exits
(it watches its parent). A stage that dies fails the replica's health check, and Serve starts a new replica with a
new placement group.
"""

from __future__ import annotations

import logging
import subprocess
import time
from typing import Any

from mlc.cluster.resources import bundle_actor_options, rank_share
from mlc.engine.launch import Launched

log = logging.getLogger("mlc.cluster.stages")
START_TIMEOUT_S = 120.0  # for a stage's host actor to be placed and start its process
POLL_EVERY_S = 1.0  # a stage's liveness is asked at most this often (the control pipe's EOF is seen at once)


def node_address() -> str:
    """The address this replica's node joined the cluster with (a local head's is 127.0.0.1), as Ray records it;
    `ray.util.get_node_ip_address` in a worker guesses from the machine's routes instead."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    found = (n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)
    return next(found, ray.util.get_node_ip_address())


class StageHost:
    """A Ray actor in one stage's bundle: starts that stage's process on its node and answers for it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, args: list[str], env: dict[str, str]) -> dict[str, Any]:
        import os
        import sys

        import ray

        self.proc = subprocess.Popen([sys.executable, *args], env={**os.environ, **env})
        return {"pid": self.proc.pid, "node": node_address(), "node_id": ray.get_runtime_context().get_node_id()}

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def wait(self, timeout: float | None) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()


class RemoteStage:
    """The replica's handle on a stage process that a `StageHost` started (what `subprocess.Popen` offers)."""

    def __init__(self, rank: int, stage: int, host: Any, info: dict[str, Any]) -> None:
        self.rank, self.stage, self.host, self.info = rank, stage, host, info
        self.returncode: int | None = None
        self._asked = time.monotonic()

    def _ask(self, call: Any, timeout: float) -> int | None:
        import ray

        try:
            return ray.get(call, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise subprocess.TimeoutExpired(f"stage {self.rank}", timeout) from None
        except ray.exceptions.RayError:  # the host actor (or its node) is gone, and the stage with it
            return -9

    def poll(self) -> int | None:
        if self.returncode is None and time.monotonic() - self._asked >= POLL_EVERY_S:
            self._asked = time.monotonic()
            try:
                self.returncode = self._ask(self.host.poll.remote(), 30.0)
            except subprocess.TimeoutExpired:
                self.returncode = -9  # a host that cannot answer in 30 s is lost to this replica
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._ask(self.host.wait.remote(timeout), (timeout or 3600.0) + 30.0)
            if code is None:
                raise subprocess.TimeoutExpired(f"stage {self.rank}", timeout or 0.0)
            self.returncode = code
        return self.returncode

    def kill(self) -> None:
        self.host.kill.remote()


class RayStageLauncher:
    """Starts a replica's pipeline stages in its placement group, stage r in bundle r (`mlc.engine.launch`)."""

    spans_nodes = True

    def __init__(self, placement_group: Any, bundles: list[dict[str, float]], ranks_per_stage: int) -> None:
        self.placement_group, self.bundles, self.ranks = placement_group, bundles, ranks_per_stage
        self.host = node_address()  # the replica's node: its stages dial back here
        self.started: list[RemoteStage] = []

    def device_index(self, rank: int) -> int:
        # Ray gives each host one device of its bundle (CUDA_VISIBLE_DEVICES, or ASCEND_RT_VISIBLE_DEVICES for the
        # NPU resource), which its process then sees as device 0
        return 0

    def start(self, rank: int, args: list[str], env: dict[str, str]) -> Launched:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        stage = rank // self.ranks  # global rank g is TP rank g % tp of stage g // tp (distributed/pipeline.py)
        strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=stage)
        actor: Any = ray.remote(StageHost)  # Ray's stubs do not follow an actor class's methods
        share = rank_share(self.bundles[stage], self.ranks)
        host = actor.options(scheduling_strategy=strategy, **bundle_actor_options(share)).remote()
        try:
            info: dict[str, Any] = ray.get(host.start.remote(args, env), timeout=START_TIMEOUT_S)
        except ray.exceptions.RayError as e:
            ray.kill(host)
            raise OSError(f"rank {rank}'s host actor could not start it in bundle {stage} of the replica's "
                          f"placement group: {e}") from None
        log.info("pipeline stage %d (rank %d) runs on node %s (%s), pid %d", stage, rank, info["node"],
                 info["node_id"][:12], info["pid"])
        remote = RemoteStage(rank, stage, host, info)
        self.started.append(remote)
        return remote

    def nodes(self) -> list[dict[str, Any]]:
        """Where each started stage runs (for the replica's status)."""
        return [{"stage": s.stage, "rank": s.rank, "node": s.info["node"], "node_id": s.info["node_id"],
                 "pid": s.info["pid"]} for s in self.started]

    def close(self) -> None:
        import ray

        for stage in self.started:
            try:
                ray.kill(stage.host)
            except Exception:  # already gone with its node
                pass
        self.started.clear()
