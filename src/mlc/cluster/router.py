"""The gateway's request router for the replica deployment: prefix affinity (`affinity.choose`) on Ray Serve's
request-router interface. It runs inside the gateway process, where it counts the requests it has in flight on
each replica; the decisions it takes are counted in `affinity.DECISIONS` for the gateway's /metrics.

Serve tells a router which replica a request went to only on some paths (`on_request_routed` needs its strict
queue-length protocol); the pending request's future, which Serve resolves with the chosen replica on every
path, is what this router watches instead."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from mlc.cluster.affinity import AffinityTable, choose


def _chunks(pending: PendingRequest | None) -> tuple[str, ...]:
    if pending is None or not pending.args:
        return ()
    return tuple(getattr(pending.args[0], "affinity", ()) or ())


class PrefixAffinityRouter(RequestRouter):
    # Ray calls it with the deployment's request_router_kwargs; its base class declares only **kwargs
    def initialize_state(self, max_load_gap: int = 4, capacity: int = 200_000) -> None:  # type: ignore[override]
        self._max_load_gap = max_load_gap
        self._table = AffinityTable(capacity)
        self._in_flight: Counter = Counter()
        self._watched: dict[int, str] = {}  # id(pending future) -> the latest decision for it

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if not by_id:
            return []
        chunks = _chunks(pending_request)
        ranks, decision = choose(chunks, {rid: self._in_flight[rid] for rid in by_id}, self._table,
                                 self._max_load_gap)
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every rank tried: back off before the next try
            self._watch(pending_request.future, chunks, decision)
        return [[by_id[rid] for rid in rank] for rank in ranks if rank]

    def _watch(self, future: asyncio.Future, chunks: tuple[str, ...], decision: str) -> None:
        """When Serve resolves the request's future with a replica: count it in flight there, and remember that
        the replica now holds the prompt's prefix."""
        key = id(future)
        first = key not in self._watched
        self._watched[key] = decision
        if not first:
            return

        def routed(f: asyncio.Future) -> None:
            final = self._watched.pop(key, "no_prefix")
            if f.cancelled() or f.exception() is not None:
                return
            rid = f.result().replica_id.unique_id
            self._in_flight[rid] += 1
            if chunks:
                self._table.record(chunks, rid)
            from mlc.cluster import affinity  # the module itself: Serve may ship this class by value

            affinity.DECISIONS[final] += 1

        future.add_done_callback(routed)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = replica_id.unique_id
        self._in_flight[rid] = max(0, self._in_flight[rid] - 1)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self._in_flight) - {r.replica_id.unique_id for r in replicas}
        super().update_replicas(replicas)
        if gone:
            self._table.forget(gone)
            for rid in gone:
                self._in_flight.pop(rid, None)
