"""Stored responses of /v1/responses (`store: true`), for GET, DELETE and previous_response_id.

In this process's memory only: a restart forgets them, and replicas behind a load balancer do not share them. At
most `capacity` responses are kept, each for at most `max_age_s` seconds; the oldest go first. Each keeps the
conversation that produced it as chat messages (without its instructions, which previous_response_id does not
carry over), so a follow-up renders exactly that history before its own input.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from mlc.errors import NotFoundError

CAPACITY = 1024
MAX_AGE_S = 3600.0


@dataclass
class StoredResponse:
    response: dict
    history: list[dict]  # chat messages: every earlier turn, this input, this reply
    stored_at: float
    input_items: list[dict] = field(default_factory=list)  # this response's input as items with ids


class ResponseStore:
    def __init__(self, capacity: int = CAPACITY, max_age_s: float = MAX_AGE_S, clock=time.monotonic):
        self.capacity, self.max_age_s, self.clock = capacity, max_age_s, clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        self._evict()
        return len(self._items)

    def _evict(self) -> None:
        oldest = self.clock() - self.max_age_s
        while self._items and (len(self._items) > self.capacity or
                               next(iter(self._items.values())).stored_at < oldest):
            self._items.popitem(last=False)

    def put(self, response: dict, history: list[dict], input_items: list[dict] | None = None) -> None:
        self._items[response["id"]] = StoredResponse(response, history, self.clock(), input_items or [])
        self._items.move_to_end(response["id"])
        self._evict()

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        self._evict()
        found = self._items.get(response_id)
        if found is None:
            raise NotFoundError(f"no stored response {response_id!r}: it was never stored (store: false), was "
                                f"deleted, or was evicted (this server keeps the last {self.capacity} responses for "
                                f"{self.max_age_s / 60:g} minutes, in memory)", field=param)
        return found

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]
