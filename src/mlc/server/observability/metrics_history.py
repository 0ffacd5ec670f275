"""What the dashboard draws: recent requests' latencies (exact percentiles over a window) and one sample of the
engine's load per second for the last ten minutes, kept in memory by the server.

The Prometheus text at /metrics has the same numbers as counters and histograms; a browser would have to parse it
and difference it over time, so `/api/metrics` hands out this history as JSON instead.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlc.engine.outputs import EngineStats

SAMPLE_INTERVAL_S = 1.0
HISTORY_S = 600  # ten minutes of one-second samples
LATENCY_WINDOW_S = 300.0  # percentiles cover requests finished in the last five minutes
CHART_WINDOW_S = 60.0  # each sample's latency percentiles cover the minute before it
MAX_RECENT = 20_000


@dataclass
class FinishedRequest:
    time: float  # monotonic, when it finished
    ttft: float | None
    tpot: float | None
    e2e: float
    output_tokens: int


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between closest ranks; None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary(values: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
            "mean": sum(values) / len(values) if values else None}


class LatencyWindow:
    """Finished requests of the last minutes, and totals since the server started."""

    def __init__(self):
        self.recent: deque[FinishedRequest] = deque(maxlen=MAX_RECENT)
        self.total = 0

    def add(self, ttft: float | None, tpot: float | None, e2e: float, output_tokens: int) -> None:
        self.recent.append(FinishedRequest(time.monotonic(), ttft, tpot, e2e, output_tokens))
        self.total += 1

    def since(self, seconds: float, now: float | None = None) -> list[FinishedRequest]:
        cutoff = (now if now is not None else time.monotonic()) - seconds
        while self.recent and self.recent[0].time < cutoff - LATENCY_WINDOW_S:
            self.recent.popleft()  # older than any window asks for
        return [r for r in self.recent if r.time >= cutoff]

    def stats(self, seconds: float = LATENCY_WINDOW_S) -> dict:
        rows = self.since(seconds)
        return {
            "window_s": seconds, "requests": len(rows),
            "ttft_s": summary([r.ttft for r in rows if r.ttft is not None]),
            "tpot_s": summary([r.tpot for r in rows if r.tpot is not None]),
            "e2e_s": summary([r.e2e for r in rows]),
        }


class MetricsHistory:
    """One sample per second of the engine's load; rates come from differences of the engine's counters."""

    def __init__(self, stats: Callable[[], EngineStats | None], waiting: Callable[[], int], latency: LatencyWindow):
        self.stats = stats
        self.waiting = waiting
        self.latency = latency
        self.samples: deque[dict] = deque(maxlen=int(HISTORY_S / SAMPLE_INTERVAL_S))
        self._last: tuple[float, EngineStats] | None = None
        self._handle: asyncio.Handle | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Sample on the server's event loop (where /metrics reads the same stats) until the loop closes."""
        def tick() -> None:
            self.sample()
            self._handle = loop.call_later(SAMPLE_INTERVAL_S, tick)

        self._handle = loop.call_soon(tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()

    def sample(self) -> dict | None:
        s = self.stats()
        if s is None:
            return None
        now, wall = time.monotonic(), time.time()
        row = {"t": wall, "running": s.num_running, "waiting": max(s.num_waiting, self.waiting()),
               "kv_cache_usage": s.kv_cache_usage, "generation_tps": None, "prompt_tps": None,
               "prefix_hit_rate": None}
        if self._last is not None:
            then, prev = self._last
            dt = max(now - then, 1e-6)
            row["generation_tps"] = (s.generation_tokens - prev.generation_tokens) / dt
            row["prompt_tps"] = (s.prompt_tokens - prev.prompt_tokens) / dt
            queries = s.prefix_cache_queries - prev.prefix_cache_queries
            if queries > 0:
                row["prefix_hit_rate"] = (s.prefix_cache_hits - prev.prefix_cache_hits) / queries
        recent = self.latency.since(CHART_WINDOW_S, now)
        row["ttft_p50"] = percentile([r.ttft for r in recent if r.ttft is not None], 50)
        row["ttft_p90"] = percentile([r.ttft for r in recent if r.ttft is not None], 90)
        row["tpot_p50"] = percentile([r.tpot for r in recent if r.tpot is not None], 50)
        row["finished"] = self.latency.total
        self._last = (now, s)
        self.samples.append(row)
        return row

    def since(self, t: float | None) -> list[dict]:
        """Samples newer than wall-clock time `t` (all of them for None)."""
        return [r for r in self.samples if t is None or r["t"] > t]
