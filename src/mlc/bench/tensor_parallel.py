"""`mlc-cli bench tp`: the same offline workload at several tensor-parallel sizes, in one run, against TP=1."""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass, field

from mlc.bench.offline import run_ours
from mlc.bench.prompts import chat_prompts
from mlc.config.engine_config import EngineConfig


@dataclass
class TPRow:
    size: int
    throughput_tok_s: float
    decode_tok_s: float
    ttft_s: float | None
    greedy_equal_to_tp1: float | None  # share of 5 prompts x 32 greedy tokens equal to TP=1's
    weights: str = ""


@dataclass
class TPReport:
    model: str
    num_prompts: int
    max_new_tokens: int
    rows: list[TPRow] = field(default_factory=list)

    def ratio(self, row: TPRow, what: str) -> float | None:
        base = getattr(self.rows[0], what)
        return getattr(row, what) / base if base else None

    def to_json(self) -> dict:
        return asdict(self)


def run_tp(config: EngineConfig, sizes: list[int], num_prompts: int = 32, max_new_tokens: int = 64) -> TPReport:
    prompts = chat_prompts(num_prompts)
    report = TPReport(config.model, num_prompts, max_new_tokens)
    reference = None
    for size in sizes:
        cfg = config.model_copy(update={"tensor_parallel_size": size})
        batch, single, _, greedy, _, facts = run_ours(cfg, prompts, max_new_tokens)
        gc.collect()
        agree = None if reference is None else sum(a == b for a, b in zip(greedy, reference)) / len(reference)
        reference = reference or greedy
        report.rows.append(TPRow(size, batch.tok_s, single.tok_s, single.ttft_s, agree, facts["weights"]))
    return report
