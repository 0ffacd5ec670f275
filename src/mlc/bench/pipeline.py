"""`mlc-cli bench pp`: the bubble of pipeline parallelism. The same greedy chat batch on one process, then on
`stages` stages with a batch queue of depth 1 (each micro-batch goes through every stage before the next starts:
the stages take turns) and of depth = stages (the driver keeps that many micro-batches in flight). Per stage: busy
time (computing its layers, not waiting for hidden states) over the wall time of the run."""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass, field

from mlc.bench.prompts import chat_prompts
from mlc.config.engine_config import EngineConfig


@dataclass
class PPRow:
    label: str
    stages: int
    depth: int
    seconds: float
    output_tokens: int
    utilization: list[float]  # per stage: busy / wall
    greedy_equal: bool | None  # the tokens equal the one-process run's

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


@dataclass
class PPReport:
    model: str
    num_prompts: int
    max_new_tokens: int
    rows: list[PPRow] = field(default_factory=list)

    def to_json(self) -> dict:
        return {**asdict(self), "rows": [{**asdict(r), "tok_s": r.tok_s} for r in self.rows]}


def _run(config: EngineConfig, prompts: list[list[dict]], max_new_tokens: int):
    from mlc.engine.llm import LLM
    from mlc.engine.sampling_params import SamplingParams

    llm = LLM(config=config)
    try:
        ids = [llm.render_chat(p) for p in prompts]
        # warm up kernels, allocator and page cache on the same prompts (a cold first run took 5x longer here);
        # their prompts then hit the prefix cache, so the measured run is mostly decode, where the bubble shows
        llm.generate(ids, SamplingParams(max_new_tokens=2, temperature=0.0))
        pipe = llm.engine.pipeline
        before = [busy for busy, _ in pipe.utilization()] if pipe else []
        start = time.perf_counter()
        outs = llm.generate(ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True))
        wall = time.perf_counter() - start
        used = [(busy - b) / wall for (busy, _), b in zip(pipe.utilization(), before)] if pipe else [1.0]
        tokens = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
    return wall, tokens, used


def run_pp(config: EngineConfig, stages: int = 2, num_prompts: int = 16, max_new_tokens: int = 32) -> PPReport:
    prompts = chat_prompts(num_prompts)
    report = PPReport(config.model, num_prompts, max_new_tokens)
    reference = None
    for label, size, depth in (("one process", 1, 1), ("depth 1", stages, 1), (f"depth {stages}", stages, stages)):
        cfg = config.model_copy(update={"pipeline_parallel_size": size, "pipeline_depth": depth})
        wall, tokens, used = _run(cfg, prompts, max_new_tokens)
        reference = reference or tokens
        report.rows.append(PPRow(label, size, depth, wall, sum(map(len, tokens)), used,
                                 None if size == 1 else tokens == reference))
    return report
