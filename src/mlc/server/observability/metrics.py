"""Prometheus metrics with vLLM's names under an `mlc:` prefix.

Latency histograms are observed by the server as requests finish; engine counters and gauges (running/waiting,
KV usage, prefix cache, preemptions, token counts) are read from `LLMEngine.stats()` at scrape time.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request, Security
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlc.server.bearer import bearer_scheme
from mlc.server.observability.metrics_history import LatencyWindow, MetricsHistory
from mlc.server.protocol.responses_doc import AUTH_RESPONSES

if TYPE_CHECKING:
    from mlc.engine.outputs import EngineStats, RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0)
COUNTED_PREFIXES = ("/v1/", "/generate", "/tokenize", "/detokenize")
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)


class EngineCollector(Collector):
    """Engine state at scrape time; zeros while the model loads."""

    def __init__(self, model: str, stats: Callable[[], EngineStats | None], waiting: Callable[[], int],
                 page_size: int):
        self.model = model
        self.stats = stats
        self.waiting = waiting
        self.page_size = page_size  # the engine counts prefix-cache pages; vLLM's metric counts tokens

    def collect(self):
        s = self.stats()
        labels = [self.model]

        def gauge(name: str, doc: str, value: float):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("mlc:num_requests_running", "Sequences in the running batch.", s.num_running if s else 0)
        yield gauge("mlc:num_requests_waiting", "Requests admitted and waiting for the batch.",
                    max(s.num_waiting if s else 0, self.waiting()))
        yield gauge("mlc:kv_cache_usage_perc", "Share of KV cache pages in use (1 = full).",
                    s.kv_cache_usage if s else 0.0)
        yield counter("mlc:prefix_cache_queries", "Prompt tokens looked up in the prefix cache (whole pages).",
                      s.prefix_cache_queries * self.page_size if s else 0)
        yield counter("mlc:prefix_cache_hits", "Prompt tokens found in the prefix cache (whole pages).",
                      s.prefix_cache_hits * self.page_size if s else 0)
        yield counter("mlc:num_preemptions", "Sequences preempted (pages freed, recomputed later).",
                      s.num_preemptions if s else 0)
        yield counter("mlc:prompt_tokens", "Prompt tokens admitted.", s.prompt_tokens if s else 0)
        yield counter("mlc:generation_tokens", "Tokens generated.", s.generation_tokens if s else 0)
        kv = s.kv_transfer if s else None
        yield counter("mlc:kv_transfer_received_bytes", "KV bytes pulled from prefill instances (decode role).",
                      kv.bytes_received if kv else 0)
        yield counter("mlc:kv_transfer_sent_bytes", "KV bytes sent to decode instances (prefill role).",
                      kv.bytes_sent if kv else 0)
        yield counter("mlc:kv_transfer_seconds", "Time requests waited for their KV: from page reservation to the "
                      "pulled pages in place (decode role).", kv.transfer_seconds if kv else 0.0)
        yield counter("mlc:kv_transfer_imports", "Requests continued from a prefill instance's KV.",
                      kv.imports if kv else 0)
        yield counter("mlc:kv_transfer_recomputed", "Requests whose transfer failed or did not fit, computed here.",
                      kv.imports_recomputed if kv else 0)
        yield counter("mlc:kv_transfer_pages_skipped", "KV pages not pulled: the decoder's prefix cache held them.",
                      kv.pages_skipped if kv else 0)
        yield counter("mlc:kv_leases_expired", "KV leases that expired before a decoder pulled them.",
                      kv.leases_expired if kv else 0)
        yield gauge("mlc:kv_leases", "KV leases held now (prefill role).", s.kv_leases if s else 0)
        spec = s.spec if s else None
        yield counter("mlc:spec_decode_num_drafts", "Sequence-steps that verified speculative tokens.",
                      spec.proposals if spec else 0)
        yield counter("mlc:spec_decode_num_draft_tokens", "Speculative tokens verified.", spec.drafted if spec else 0)
        yield counter("mlc:spec_decode_num_accepted_tokens", "Speculative tokens accepted.",
                      spec.accepted if spec else 0)
        yield counter("mlc:spec_decode_draft_seconds", "Time spent proposing speculative tokens.",
                      spec.draft_time_s if spec else 0.0)
        per_pos = CounterMetricFamily("mlc:spec_decode_num_accepted_tokens_per_pos",
                                      "Speculative tokens accepted, by position in the draft (0: the first).",
                                      labels=["model_name", "position"])
        drafted_at = spec.drafted_at if spec else []
        for pos, n in enumerate(spec.accepted_at if spec else []):
            if drafted_at[pos]:
                per_pos.add_metric([self.model, str(pos)], n)
        yield per_pos
        if s and s.stage_busy:  # pipeline parallelism: each stage's busy time over wall time is its utilization
            busy = CounterMetricFamily("mlc:pipeline_stage_busy_seconds", "Time each pipeline stage spent computing "
                                       "its layers (not waiting for hidden states).", labels=["model_name", "stage"])
            steps = CounterMetricFamily("mlc:pipeline_stage_steps", "Micro-batches each pipeline stage ran.",
                                        labels=["model_name", "stage"])
            for stage, (seconds, n) in enumerate(s.stage_busy):
                busy.add_metric([self.model, str(stage)], seconds)
                steps.add_metric([self.model, str(stage)], n)
            yield busy
            yield steps


def _os_threads() -> int:
    """Threads the kernel counts for this process (Python's and the compute library's); Python's alone where
    /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    except (OSError, StopIteration, ValueError):
        return threading.active_count()


class RuntimeCollector:
    """The server process's own load, what a soak watches for creep: threads and the event loop's asyncio tasks
    (prometheus_client's process collector beside it gives RSS, open fds and CPU time)."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None

    def collect(self):
        g = GaugeMetricFamily("mlc:server_threads", "Threads of the server process (its compute threads too).")
        g.add_metric([], _os_threads())
        yield g
        if self.loop is not None:
            t = GaugeMetricFamily("mlc:server_asyncio_tasks", "Tasks on the server's event loop.")
            t.add_metric([], len(asyncio.all_tasks(self.loop)))
            yield t


class ServerMetrics:
    def __init__(self, model: str):
        self.model = model
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, process_open_fds, ...
        self.runtime = RuntimeCollector()
        self.registry.register(self.runtime)
        self.engine_collector: EngineCollector | None = None
        self.latency = LatencyWindow()  # for the dashboard: exact recent percentiles
        self.history: MetricsHistory | None = None
        r, labels = self.registry, ["model_name"]
        self.ttft = Histogram("mlc:time_to_first_token_seconds", "Time from request to its first token.", labels,
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("mlc:time_per_output_token_seconds", "Mean time per output token after the first.",
                              labels, buckets=TOKEN_BUCKETS, registry=r)
        self.itl = Histogram("mlc:inter_token_latency_seconds", "Time between consecutive tokens.", labels,
                             buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("mlc:e2e_request_latency_seconds", "Time from request to its last token.", labels,
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue = Histogram("mlc:request_queue_time_seconds", "Time a request waited before its first step.",
                               labels, buckets=REQUEST_BUCKETS, registry=r)
        self.finished = Counter("mlc:request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self.rejected = Counter("mlc:request_rejected", "Requests refused before reaching the engine.",
                                labels + ["reason"], registry=r)
        self.api_requests = Counter("mlc:api_requests", "HTTP requests to the API by route (its path template: "
                                    "/v1/chat/completions, /v1/responses, /v1/messages, ...) and status.",
                                    labels + ["route", "status"], registry=r)
        self.closed = Counter("mlc:connections_closed", "Connections the server cut: a request's head or body that "
                              "did not arrive in time (--header-timeout, --body-timeout).", labels + ["reason"],
                              registry=r)

    def count_closed(self, reason: str) -> None:
        self.closed.labels(self.model, reason).inc()

    def watch_engine(self, stats: Callable[[], EngineStats | None], waiting: Callable[[], int], page_size: int):
        self.engine_collector = EngineCollector(self.model, stats, waiting, page_size)
        self.registry.register(self.engine_collector)
        self.runtime.loop = asyncio.get_running_loop()
        self.history = MetricsHistory(stats, waiting, self.latency)
        self.history.start(asyncio.get_running_loop())  # called on the server's loop once the model is loaded

    def observe(self, out: RequestOutput, start: float, first_output: float | None, end: float) -> None:
        """One finished request: TTFT and E2E from the server's clock, token gaps from the engine's."""
        m = self.model
        if first_output is not None:
            self.ttft.labels(m).observe(first_output - start)
        self.e2e.labels(m).observe(end - start)
        queue_time = out.metrics.queue_time
        if queue_time is not None:
            self.queue.labels(m).observe(max(queue_time, 0.0))
        times = out.metrics.token_times
        for a, b in zip(times, times[1:]):
            self.itl.labels(m).observe(b - a)
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        if tpot is not None:
            self.tpot.labels(m).observe(tpot)
        ttft = first_output - start if first_output is not None else None
        self.latency.add(ttft, tpot, end - start, out.num_generated_tokens)

    def count_finished(self, reason: str) -> None:
        self.finished.labels(self.model, reason).inc()

    def count_rejected(self, reason: str) -> None:
        self.rejected.labels(self.model, reason).inc()

    def count_request(self, route: str, status: int) -> None:
        self.api_requests.labels(self.model, route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RouteCounter:
    """Counts every API request by the route it matched and the status it got (`mlc:api_requests_total`), so each
    API (chat, completions, Responses, Messages, native) shows apart."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(COUNTED_PREFIXES):
            await self.app(scope, receive, send)
            return
        status = 500

        async def noted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, noted)
        finally:  # the router put the matched route in the scope; an unknown path has none
            self.metrics.count_request(getattr(scope.get("route"), "path", "unmatched"), status)


router = APIRouter(tags=["metrics"], dependencies=[Security(bearer_scheme)])


@router.get("/metrics", response_class=Response, summary="Prometheus metrics",
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                             "description": "Prometheus text format; names start with mlc:"}, **AUTH_RESPONSES})
async def metrics(request: Request):
    return Response(request.app.state.mlc.metrics.render(), media_type=CONTENT_TYPE_LATEST)
