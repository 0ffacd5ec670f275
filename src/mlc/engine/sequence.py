"""A sequence being generated: its tokens, its pages, how much of it the cache holds, and why it finished."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mlc.engine.grammar import Grammar

if TYPE_CHECKING:
    from llguidance import LLMatcher
from mlc.engine.sampling_params import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a sequence ended; a str so that it serializes as its value in every API."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens or the context limit
    ABORT = "abort"  # cancelled: client gone, shutdown, or an explicit abort
    TIMEOUT = "timeout"  # --request-timeout
    ERROR = "error"  # a failed engine step (engine/recovery.py)

    def __str__(self) -> str:
        return self.value


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(eq=False)  # identity: queues find and remove a sequence by what it is, not by its field values
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter_id: int = 0  # 0: base model
    sample_index: int = 0  # which of the request's n samples
    fair_group: str | None = None  # opaque fairness id: the scheduler queues groups round-robin (server: API key)
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)  # for prompt tokens 1.. (token 0 has none)
    status: Status = Status.WAITING
    page_table: list[int] = field(default_factory=list)
    page_hashes: list[int] = field(default_factory=list)  # prefix-cache hashes of the full pages computed so far
    num_cached: int = 0  # tokens whose KV is in the cache (cache entries == tokens; sparse KV may compact)
    num_cache_entries: int = 0  # entries this sequence holds in its pages (== num_cached without sparse KV)
    kv_positions: torch.Tensor | None = None  # sparse KV: token position of each entry at the last compaction
    num_prefix_hit: int = 0  # prompt tokens served from the prefix cache at admission
    finish_reason: FinishReason | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    max_len: int | None = None  # prompt + output bound for this sequence
    grammar: Grammar | None = None  # the request's compiled grammar (structured outputs), shared by its samples
    matcher: LLMatcher | None = None  # this sequence's own place in it: moved on by the scheduler, read by the sampler
    draft_ids: list[int] = field(default_factory=list)  # speculative tokens proposed for the next step (unverified)
    drafter: object | None = None  # the drafter's own state for this sequence (engine/speculative.py)
    adapter_key: int = 0  # the prefix cache's key for the adapter (its contents' digest); 0: use adapter_id

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed + self.sample_index)
        if self.grammar is not None and self.matcher is None:
            self.matcher = self.grammar.matcher()

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return len(self) - self.num_cached

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: FinishReason) -> None:
        self.status = Status.FINISHED
        self.finish_reason = FinishReason(reason)


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: `num_tokens` new tokens run through the model, the last `num_draft` of them
    speculative (its `draft_ids`, each verified as a decode row of its own)."""

    seq: Sequence
    num_tokens: int
    num_draft: int = 0

    @property
    def completes(self) -> bool:
        """After this step the sequence's KV covers all its tokens, so its next token is sampled."""
        return self.seq.num_cached + self.num_tokens - self.num_draft == len(self.seq)
