"""A pipeline stage after the first: rank r of a pipeline-parallel group. It loads the model, keeps its own layers
(`engine/pp_stage.py`), allocates their KV pages, then runs the driver's steps until told to stop or the driver is
gone. For each step it takes the hidden states from the stage before, runs its layers, and sends on what they
leave: to the next stage, or, on the last stage, the next-token logits to the driver, which samples."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from mlc.engine.tp_worker import CacheHolder, join_group, serve_commands

if TYPE_CHECKING:
    import torch

    from mlc.config.engine_config import EngineConfig
    from mlc.distributed.pipeline import PipelineLinks
    from mlc.engine.model_runner import StepInputs
    from mlc.engine.page_manager import PageCopy


class Stage(CacheHolder):
    def __init__(self, config: EngineConfig, device: torch.device, rank: int, ranges: list[list[int]],
                 links: PipelineLinks) -> None:
        from mlc.engine.pp_stage import cut_to_stage, stage_input
        from mlc.models.loader import load_model

        self.rank, self.last, self.links, self.device = rank, rank == len(ranges) - 1, links, device
        model = load_model(config.model, device, config.dtype, config.weight_dtype, verify=False)
        first, end = ranges[rank]
        self.model = cut_to_stage(model, (first, end), first=False, last=self.last)
        embed = stage_input(self.model)
        assert embed is not None
        self.input = embed
        self.hidden_size = int(model.config.hidden_size)
        self.sends: list[tuple[torch.Tensor, Any]] = []  # hidden states on their way to the next stage

    def cache_spec(self) -> list[dict[str, tuple[int, ...]]]:
        return self.model.stage_cache_spec()  # only this stage's layers

    def execute(self, copies: list[PageCopy], step: StepInputs, tag: int) -> dict[str, Any]:
        """This stage's part of one micro-batch; returns its busy seconds (and, on the last stage, the prompt
        logprobs the step scored)."""
        import torch
        import torch.distributed as dist

        self.runner.apply_copies(copies)
        h = torch.empty(len(step.ids), self.hidden_size, dtype=self.input.dtype, device=self.device)
        dist.recv(h, src=self.rank - 1, group=self.links.forward[self.rank - 1], tag=tag)
        start = time.perf_counter()
        self.input.pending = h
        hidden = self.runner.hidden_states(step)
        if not self.last:
            busy = time.perf_counter() - start
            hidden = hidden.contiguous()
            self.sends = [(t, w) for t, w in self.sends if not w.is_completed()]
            self.sends.append((hidden, dist.isend(hidden, dst=self.rank + 1, group=self.links.forward[self.rank],
                                                  tag=tag)))
            return {"busy": busy}
        logits, scored = self.runner.outputs(step, hidden)
        busy = time.perf_counter() - start
        if step.logit_rows:
            dist.send(logits.contiguous(), dst=0, group=self.links.back, tag=tag)
        return {"busy": busy, "scored": scored}


def stage_main(rank: int, size: int, port: int, expert_parallel: bool, engine: dict[str, Any], threads: int,
               control: int, ranges: list[list[int]]) -> None:
    import torch

    from mlc.distributed.pipeline import pipeline_links

    pipe, config, device = join_group(rank, size, port, engine, threads, control, f"stage{rank}")
    links = pipeline_links(size)

    def call(stage: Stage, method: str, args: tuple[Any, ...]) -> Any:
        with torch.inference_mode():
            return getattr(stage, method)(*args)

    serve_commands(pipe, lambda: Stage(config, device, rank, ranges, links), call)


if __name__ == "__main__":
    import json
    import sys

    stage_main(**json.loads(sys.argv[1]))
