"""`GET /api/metrics`: the dashboard's JSON: the engine's load now, recent latency percentiles, and the per-second
history since `since` (see metrics_history.py)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from mlc.server.state import ServerState


class Percentiles(BaseModel):
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    mean: float | None = None


class LatencyStats(BaseModel):
    window_s: float = Field(description="Requests finished in this many seconds before now.")
    requests: int
    ttft_s: Percentiles = Field(description="Time to first token.")
    tpot_s: Percentiles = Field(description="Mean time per output token after the first.")
    e2e_s: Percentiles = Field(description="Time from request to last token.")


class LoadNow(BaseModel):
    running: int = Field(description="Sequences in the running batch.")
    waiting: int = Field(description="Sequences admitted and waiting for the batch.")
    kv_cache_usage: float = Field(description="Share of KV cache pages in use, 0..1.")
    kv_pages_total: int
    kv_pages_free: int
    prefix_cache_hit_rate: float | None = Field(description="Prompt pages found in the prefix cache, since start.")
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    spec_acceptance_rate: float | None = Field(None, description="Speculative tokens accepted of those verified, "
                                               "since start (null: none drafted).")
    spec_mean_accepted_length: float | None = Field(None, description="Tokens a drafting sequence gained per step.")
    requests_finished: dict[str, int] = Field(description="Finished requests by finish reason, since start.")
    requests_rejected: dict[str, int] = Field(description="Requests refused before the engine, by reason.")


class HistorySample(BaseModel):
    t: float = Field(description="Server wall-clock time (Unix seconds).")
    running: int
    waiting: int
    kv_cache_usage: float
    generation_tps: float | None = Field(description="Generated tokens per second over the last interval.")
    prompt_tps: float | None
    prefix_hit_rate: float | None = Field(description="Prefix-cache hit rate of the interval's prompts.")
    ttft_p50: float | None = Field(description="Over requests finished in the minute before `t`.")
    ttft_p90: float | None
    tpot_p50: float | None
    finished: int = Field(description="Requests finished since start.")


class MetricsSnapshot(BaseModel):
    model: str
    status: str = Field(description="loading, healthy, draining or error")
    time: float = Field(description="Server wall-clock time (Unix seconds); pass as `since` next time.")
    uptime_s: float
    interval_s: float = Field(description="Seconds between history samples.")
    now: LoadNow | None = Field(description="None while the model loads.")
    latency: LatencyStats
    history: list[HistorySample]


def _by_label(counter, label: str) -> dict[str, int]:
    """A labelled Prometheus counter's totals by one label."""
    out: dict[str, int] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = sample.labels.get(label, "")
                out[key] = out.get(key, 0) + int(sample.value)
    return out


def snapshot(state: ServerState, since: float | None) -> MetricsSnapshot:
    from mlc.server.observability.metrics_history import SAMPLE_INTERVAL_S

    m = state.metrics
    s = state.stats()
    now = None
    if s is not None:
        now = LoadNow(
            running=s.num_running, waiting=max(s.num_waiting, state.waiting()), kv_cache_usage=s.kv_cache_usage,
            kv_pages_total=s.num_pages, kv_pages_free=s.num_free_pages,
            prefix_cache_hit_rate=s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else None,
            prompt_tokens=s.prompt_tokens, generation_tokens=s.generation_tokens, preemptions=s.num_preemptions,
            spec_acceptance_rate=s.spec.acceptance_rate,
            spec_mean_accepted_length=s.spec.mean_accepted_length if s.spec.proposals else None,
            requests_finished=_by_label(m.finished, "finished_reason"),
            requests_rejected=_by_label(m.rejected, "reason"),
        )
    history = m.history.since(since) if m.history is not None else []
    return MetricsSnapshot(
        model=state.model_id, status=state.status, time=time.time(), uptime_s=time.time() - state.created,
        interval_s=SAMPLE_INTERVAL_S, now=now, latency=LatencyStats(**m.latency.stats()),
        history=[HistorySample(**row) for row in history],
    )
