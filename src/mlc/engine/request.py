"""The engine's record of one request: its samples, each with its sequence, its detokenizer and what its outputs
have handed out so far."""

from __future__ import annotations

from dataclasses import dataclass

from mlc.engine.detokenizer import IncrementalDetokenizer
from mlc.engine.sampling_params import SamplingParams
from mlc.engine.sequence import Sequence


@dataclass
class Sample:
    """One of a request's `n` samples."""

    seq: Sequence
    detok: IncrementalDetokenizer
    sent_tokens: int = 0  # the outputs so far handed out this many tokens and characters: deltas start there
    sent_chars: int = 0


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    samples: list[Sample]
    pending_forks: int = 0  # samples still to fork from the first one when its prompt is done
    finished_time: float | None = None

    @property
    def seqs(self) -> list[Sequence]:
        return [s.seq for s in self.samples]

    @property
    def finished(self) -> bool:
        return self.pending_forks == 0 and all(s.seq.is_finished for s in self.samples)
