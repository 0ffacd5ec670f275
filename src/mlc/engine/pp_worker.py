"""A pipeline-parallel worker: global rank g, tensor-parallel rank g % tp of stage g // tp (`distributed/pipeline.py`;
the driver is rank 0). It loads the model, keeps its stage's layers (`engine/pp_stage.py`; its shard of them with
tp > 1), allocates their KV pages, then runs the driver's steps until told to stop or the driver is gone. For each
step a later stage takes the hidden states from its peer in the stage before (stage 0's ranks embed the tokens),
runs its layers, and sends on what they leave: to its peer in the next stage, or, on the last stage, the next-token
logits (from its TP rank 0) to the driver, which samples."""

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
    """One process of a stage: tensor-parallel rank `links.tp_rank` of stage `links.stage` (stage 0's ranks after the
    driver embed the step's tokens themselves; later stages take the hidden states from their peer before them)."""

    def __init__(self, config: EngineConfig, device: torch.device, ranges: list[list[int]],
                 links: PipelineLinks) -> None:
        from mlc.engine.pp_stage import cut_to_stage, stage_input
        from mlc.models.loader import load_model

        self.links, self.device = links, device
        self.first, self.last = links.stage == 0, links.stage == links.stages - 1
        model = load_model(config.model, device, config.dtype, config.weight_dtype, verify=False)
        first, end = ranges[links.stage]
        self.model = cut_to_stage(model, (first, end), first=self.first, last=self.last)
        self.input = stage_input(self.model)  # None on stage 0: it embeds
        self.hidden_size = int(model.config.hidden_size)
        self.sends: list[tuple[torch.Tensor, Any]] = []  # hidden states on their way to the next stage

    def cache_spec(self) -> list[dict[str, tuple[int, ...]]]:
        return self.model.stage_cache_spec()  # only this stage's layers (this rank's heads of them)

    def execute(self, copies: list[PageCopy], step: StepInputs, tag: int) -> dict[str, Any]:
        """This process's part of one micro-batch; returns its busy seconds (and, on the last stage, the prompt
        logprobs the step scored)."""
        import torch
        import torch.distributed as dist

        links = self.links
        self.runner.apply_copies(copies)
        if self.input is not None:
            h = torch.empty(len(step.ids), self.hidden_size, dtype=self.input.dtype, device=self.device)
            dist.recv(h, src=links.peer(links.stage - 1), group=links.forward[links.stage - 1], tag=tag)
            self.input.pending = h
        start = time.perf_counter()
        hidden = self.runner.hidden_states(step)
        if not self.last:
            busy = time.perf_counter() - start
            hidden = hidden.contiguous()
            self.sends = [(t, w) for t, w in self.sends if not w.is_completed()]
            self.sends.append((hidden, dist.isend(hidden, dst=links.peer(links.stage + 1),
                                                  group=links.forward[links.stage], tag=tag)))
            return {"busy": busy}
        logits, scored = self.runner.outputs(step, hidden)  # gathered over the stage's ranks: whole rows on each
        busy = time.perf_counter() - start
        if step.logit_rows and links.rank == links.last_rank:
            dist.send(logits.contiguous(), dst=0, group=links.back, tag=tag)
        return {"busy": busy, "scored": scored}


def stage_main(rank: int, size: int, host: str, port: int, expert_parallel: bool, engine: dict[str, Any],
               threads: int, control: int, device_index: int, ranges: list[list[int]], tp: int) -> None:
    import torch

    from mlc.distributed.pipeline import pipeline_links
    from mlc.distributed.state import set_parallel_state

    pipe, config, device = join_group(rank, size, host, port, engine, threads, control, device_index, f"stage{rank}")
    links = pipeline_links(len(ranges), tp, rank)
    if tp > 1:  # layers built from now on are this rank's shard of its stage's
        set_parallel_state(links.tp_rank, tp, expert_parallel, links.tp_group)

    def call(stage: Stage, method: str, args: tuple[Any, ...]) -> Any:
        with torch.inference_mode():
            return getattr(stage, method)(*args)

    serve_commands(pipe, lambda: Stage(config, device, ranges, links), call)


if __name__ == "__main__":
    import json
    import sys

    stage_main(**json.loads(sys.argv[1]))
