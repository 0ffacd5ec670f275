"""A pipeline stage after the first: rank r of a pipeline-parallel group. It loads the model, keeps its own layers
(`engine/pp_stage.py`), allocates their KV pages, then runs the driver's steps until told to stop or the driver is
gone. For each step it takes the hidden states from the stage before, runs its layers, and sends on what they
leave: to the next stage, or, on the last stage, the next-token logits to the driver, which samples."""

from __future__ import annotations

import datetime
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from mlc.engine.tp_worker import _connect, _die_with_parent

if TYPE_CHECKING:
    import torch

    from mlc.config.engine_config import EngineConfig
    from mlc.distributed.pipeline import PipelineLinks
    from mlc.engine.model_runner import ModelRunner, StepInputs
    from mlc.engine.page_manager import PageCopy


class Stage:
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
        self._runner: ModelRunner | None = None

    @property
    def runner(self) -> ModelRunner:
        if self._runner is None:
            raise RuntimeError("the driver sent a step before init_cache")
        return self._runner

    def init_cache(self, num_pages: int, page_size: int, kv_cache_dtype: str) -> None:
        from mlc.engine.kv_cache import KVCache, kv_dtype
        from mlc.engine.model_runner import ModelRunner

        dtype = kv_dtype(kv_cache_dtype, self.model.dtype)
        cache = KVCache(self.model.stage_cache_spec(), num_pages, page_size, dtype, self.device)
        self._runner = ModelRunner(self.model, cache)

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
    _die_with_parent()
    pipe = _connect(control, rank)
    logging.basicConfig(level=os.environ.get("MLC_LOG_LEVEL", "WARNING"), format=f"stage{rank} %(message)s")
    import torch
    import torch.distributed as dist

    from mlc.config.device import resolve_device
    from mlc.config.engine_config import EngineConfig
    from mlc.distributed.checks import backend_for, rank_device
    from mlc.distributed.pipeline import pipeline_links
    from mlc.engine.tp_group import COLLECTIVE_TIMEOUT_S

    torch.set_num_threads(threads)
    config = EngineConfig(**engine)
    device = rank_device(resolve_device(config.device), rank)
    backend = backend_for(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                            device_id=device if backend != "gloo" else None)
    links = pipeline_links(size)
    stage = None
    try:
        stage = Stage(config, device, rank, ranges, links)
        pipe.send(("ok", None))
    except Exception as e:
        pipe.send(("error", f"{type(e).__name__}: {e}"))
    while True:
        try:
            method, args = pipe.recv()
        except (EOFError, OSError):
            break  # the driver is gone
        if method == "stop":
            break
        try:
            with torch.inference_mode():
                detail = getattr(stage, method)(*args)
            pipe.send(("ok", detail))
        except Exception as e:
            pipe.send(("error", f"{type(e).__name__}: {e}"))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


if __name__ == "__main__":
    import json
    import sys

    stage_main(**json.loads(sys.argv[1]))
