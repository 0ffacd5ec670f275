"""The engine's record of one request: its samples, their detokenizers, and what its outputs handed out."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlc.engine.detokenizer import IncrementalDetokenizer
from mlc.engine.sampling_params import SamplingParams
from mlc.engine.sequence import Sequence


@dataclass
class Sent:
    """The one record of what a sample's outputs have handed out: deltas start here."""

    tokens: int = 0
    chars: int = 0


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    pending_forks: int = 0
    finished_time: float | None = None
    sent: list[Sent] = field(default_factory=list)  # per sample: what the outputs so far handed out

    @property
    def finished(self) -> bool:
        return self.pending_forks == 0 and all(s.is_finished for s in self.seqs)
