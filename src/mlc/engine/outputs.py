"""What the engine hands back for a request: whole texts so far plus the delta since the previous step."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlc.engine.kv_transfer import TransferStats
from mlc.engine.sequence import TokenLogprob
from mlc.engine.speculative import SpecStats
from mlc.errors import MlcError


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    token_times: list[float]
    num_prompt_tokens: int
    num_prefix_hit_tokens: int
    num_preemptions: int

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[float] | None = None  # for prompt tokens 1..n-1, when asked for
    error: MlcError | None = None  # set when a failed engine step ended this request (finish_reason "error")

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


@dataclass
class EngineStats:
    """A snapshot of the engine's load and counters (metrics, admission)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_pages: int
    num_pages: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    spec: SpecStats = field(default_factory=SpecStats)  # speculative decoding's counters (zeros without it)
    kv_transfer: TransferStats = field(default_factory=TransferStats)  # prefill/decode split (kv_transfer.py)
    kv_leases: int = 0  # KV leases held now (a prefill instance's pages waiting for their decoder)
    stage_busy: list[tuple[float, int]] = field(default_factory=list)  # pipeline stages: (busy seconds, steps)
