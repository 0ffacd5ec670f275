"""The records of `mlc-cli plan`: what is asked, what one way of running the model costs, and what comes back."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class PlanRequest:
    seq_len: int = 32768
    batch: int = 8
    dtype: str = "auto"  # compute dtype; auto -> the profile's preferred dtype
    weight_dtype: str = "auto"
    kv_dtype: str = "auto"
    page_size: int = 16
    devices: int | None = None  # None -> 1 for the requested layout; the recommendation searches
    sparse_kv_ratio: float | None = None
    max_num_batched_tokens: int = 512
    memory_fraction: float = 0.9
    group_size: int = 128


@dataclass
class Layout:
    """One way to run the model, and what it costs per device."""

    weight_dtype: str
    kv_dtype: str
    sparse_kv_ratio: float | None
    devices: int
    tensor_parallel: int
    pipeline_parallel: int
    expert_parallel: bool = False  # MoE: whole experts spread over the TP ranks (serve --enable-expert-parallel)
    weight_bytes: int = 0
    kv_bytes_per_token: int = 0  # per device, all layers of its stage
    kv_bytes_per_token_exact: bool = True
    tokens_per_seq: int = 0  # cache entries one sequence keeps at seq_len
    pages_per_seq: int = 0
    pages: int = 0  # batch x pages_per_seq + the null page
    kv_bytes: int = 0
    activation_bytes: int = 0
    reserve_bytes: int = 0
    total_bytes: int = 0
    capacity_bytes: int = 0
    fits: bool = False
    max_batch: int = 0
    decode_tok_s: float = 0.0  # all sequences of the batch together
    decode_tok_s_per_seq: float = 0.0
    bound: str = ""  # memory | compute | interconnect
    tier: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass
class PlanResult:
    model: dict
    hardware: dict
    request: dict
    requested: Layout
    recommendation: Layout | None
    reason: str
    alternatives: list[Layout]
    notes: list[str]
    command: str | None = None  # the serve line that runs the recommendation (or the request)

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "hardware": self.hardware,
            "request": self.request,
            "requested": asdict(self.requested),
            "recommendation": asdict(self.recommendation) if self.recommendation else None,
            "reason": self.reason,
            "alternatives": [asdict(a) for a in self.alternatives],
            "notes": self.notes,
            "command": self.command,
        }
