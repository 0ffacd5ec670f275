"""Per-key limits at admission, and per-key counters in /metrics.

Each named key (server/keys.py) may limit requests per minute, tokens per minute and requests in flight; windows
roll over the last 60 seconds. The tokens rule: a request is charged its prompt tokens + n x max_tokens when it is
admitted (what it may use at most), and the charge is corrected to the prompt + the tokens really generated when it
ends, so a request that stops early gives the rest back to its key's minute. A request that would pass a limit gets
429 with `Retry-After` (the seconds until the window lets it in) and an OpenAI-style body whose `param` names the
limit. Plain --api-key keys and servers without keys are not limited or counted here.

Engine requests count one by one: a completions request with several prompts is several requests in flight.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from mlc.errors import QueueFullError, RequestTooLargeError
from mlc.server.keys import KeyEntry

WINDOW_S = 60.0


class RateLimitError(QueueFullError):
    """A key's limit is reached: 429 with Retry-After; `field` names the limit."""

    error_type = "rate_limit_exceeded"

    def __init__(self, message: str, *, limit: str, retry_after: int):
        super().__init__(message, retry_after=retry_after)
        self.field = limit


@dataclass
class Charge:
    time: float
    tokens: int


@dataclass
class KeyUsage:
    """One key's last minute: admission times, token charges, requests in flight."""

    admitted: deque[float] = field(default_factory=deque)
    charges: deque[Charge] = field(default_factory=deque)
    in_flight: int = 0

    def prune(self, now: float) -> None:
        while self.admitted and self.admitted[0] <= now - WINDOW_S:
            self.admitted.popleft()
        while self.charges and self.charges[0].time <= now - WINDOW_S:
            self.charges.popleft()


@dataclass
class Ticket:
    """An admitted request's claim on its key: `release` corrects the token charge and frees its place."""

    name: str
    charge: Charge
    prompt_tokens: int
    tenants: Tenants
    released: bool = False

    def release(self, completion_tokens: int) -> None:
        if not self.released:
            self.released = True
            self.tenants.release(self, completion_tokens)


def _wait(t: float, now: float) -> int:
    return max(1, math.ceil(t + WINDOW_S - now))


class Tenants:
    def __init__(self, registry: CollectorRegistry, model: str, clock: Callable[[], float] = time.monotonic):
        self.model = model
        self.clock = clock
        self.usage: dict[str, KeyUsage] = {}
        labels = ["model_name", "key"]
        self.requests = Counter("mlc:key_requests", "Requests admitted, by API key name.", labels, registry=registry)
        self.tokens = Counter("mlc:key_tokens", "Tokens used (prompt + completion as they ended), by API key name.",
                              labels + ["kind"], registry=registry)
        self.limited = Counter("mlc:key_rate_limited", "Requests refused with 429 by a key's limit, by key name and "
                               "limit.", labels + ["limit"], registry=registry)
        self.in_flight = Gauge("mlc:key_requests_in_flight", "Requests running or waiting, by API key name.", labels,
                               registry=registry)

    def admit(self, entry: KeyEntry, prompt_tokens: int, max_tokens: int) -> Ticket:
        """Charge `entry`'s key for a request that may use `prompt_tokens + max_tokens`, or raise 429 (or 400 for a
        request its tokens-per-minute limit can never hold)."""
        now = self.clock()
        use = self.usage.setdefault(entry.name, KeyUsage())
        use.prune(now)
        ask = prompt_tokens + max_tokens
        if entry.max_concurrent is not None and use.in_flight >= entry.max_concurrent:
            self._refuse(entry, "max_concurrent", 1, f"{use.in_flight} requests in flight, the limit is "
                         f"{entry.max_concurrent}")
        rpm = entry.requests_per_minute
        if rpm is not None and len(use.admitted) >= rpm:
            self._refuse(entry, "requests_per_minute", _wait(use.admitted[-rpm], now),
                         f"{len(use.admitted)} requests in the last minute, the limit is {rpm}")
        tpm = entry.tokens_per_minute
        if tpm is not None:
            if ask > tpm:
                raise RequestTooLargeError(
                    f"this request may use {ask} tokens ({prompt_tokens} prompt + {max_tokens} max_tokens x n), more "
                    f"than key {entry.name!r} may use in a minute ({tpm} tokens_per_minute); ask for fewer",
                    field="max_tokens")
            used = sum(c.tokens for c in use.charges)
            if used + ask > tpm:
                self._refuse(entry, "tokens_per_minute", self._tokens_free_at(use, used + ask - tpm, now),
                             f"{used} tokens in the last minute + {ask} asked, the limit is {tpm}")
        use.admitted.append(now)
        charge = Charge(now, ask)
        use.charges.append(charge)
        use.in_flight += 1
        self.requests.labels(self.model, entry.name).inc()
        self.in_flight.labels(self.model, entry.name).set(use.in_flight)
        return Ticket(entry.name, charge, prompt_tokens, self)

    @staticmethod
    def _tokens_free_at(use: KeyUsage, excess: int, now: float) -> int:
        """Seconds until charges worth `excess` tokens leave the window."""
        freed = 0
        for c in use.charges:
            freed += c.tokens
            if freed >= excess:
                return _wait(c.time, now)
        return _wait(now, now)

    def _refuse(self, entry: KeyEntry, limit: str, retry: int, detail: str) -> None:
        self.limited.labels(self.model, entry.name, limit).inc()
        raise RateLimitError(f"rate limit reached for key {entry.name!r} on {limit}: {detail}; retry after "
                             f"{retry}s", limit=limit, retry_after=retry)

    def release(self, ticket: Ticket, completion_tokens: int) -> None:
        ticket.charge.tokens = ticket.prompt_tokens + completion_tokens  # the real use replaces the estimate
        use = self.usage.setdefault(ticket.name, KeyUsage())
        use.in_flight = max(0, use.in_flight - 1)
        self.in_flight.labels(self.model, ticket.name).set(use.in_flight)
        self.tokens.labels(self.model, ticket.name, "prompt").inc(ticket.prompt_tokens)
        self.tokens.labels(self.model, ticket.name, "completion").inc(completion_tokens)
