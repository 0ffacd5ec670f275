"""The driver's side of a pipeline-parallel engine. The driver is stage 0: it embeds and runs the first layers, and
it samples. Stages 1..P-1 are worker processes (`engine/pp_worker.py`), started and watched as tensor-parallel
workers are (`TPGroup`). A step goes out as one command to every stage over its pipe (its KV page copies, its
inputs and a tag); the hidden states then travel stage to stage by point-to-point sends, and the last stage sends
the logits back to the driver.

`Pipeline` keeps up to `depth` micro-batches in flight (one per stage by default), so that while the last stage
runs micro-batch k the driver already runs micro-batch k+1 on its layers: with depth 1 every stage waits for the
others (the bubble). A sequence whose step is in flight is skipped by the scheduler (and never preempted) until
that step comes back, so no request is ever scheduled twice at once. Each micro-batch takes at most its share of the
sequences in the engine, so that decoding sequences spread over the micro-batches.

A stage that fails a step leaves the stages after it waiting for hidden states that never come: under pipeline
parallelism a failed step ends the engine (`EngineDeadError`).
"""

from __future__ import annotations

import logging
import math
import os
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from mlc.config.engine_config import EngineConfig
from mlc.distributed.pipeline import PipelineLinks, pipeline_links
from mlc.distributed.state import parallel_scope, set_parallel_state
from mlc.engine.kv_cache import KVCache
from mlc.engine.model_runner import ModelRunner, StepOutput, prepare_step
from mlc.engine.page_manager import PageCopy
from mlc.engine.scheduler import SchedulerOutput
from mlc.engine.sequence import ScheduledSeq
from mlc.engine.tp_group import TPGroup
from mlc.errors import CapacityError, ConfigError, EngineDeadError
from mlc.layers.lora import LoRAAdapter, PreparedAdapter
from mlc.models.base import CausalLM

if TYPE_CHECKING:
    from mlc.engine.outputs import RequestOutput
    from mlc.engine.recovery import Recovery
    from mlc.engine.scheduler import Scheduler
    from mlc.engine.sequence import FinishReason


class PipelinedEngine(Protocol):
    """What `Pipeline` uses of `LLMEngine`."""

    scheduler: Scheduler
    runner: ModelRunner
    recovery: Recovery

    def _finish_step(self, step: StepOutput) -> list[RequestOutput]: ...

    def abort(self, request_id: str, reason: FinishReason = ...) -> RequestOutput | None: ...

log = logging.getLogger("mlc.engine")


class PPGroup(TPGroup):
    """The stages' processes: `tp` a stage (global rank g is TP rank g % tp of stage g // tp; the driver is rank 0)."""

    worker_module = "mlc.engine.pp_worker"
    what = "pipeline-parallel"

    def __init__(self, ranges: list[tuple[int, int]], tp: int, expert_parallel: bool, device: torch.device,
                 engine_config: dict[str, Any], threads: int) -> None:
        self.ranges, self.stages, self.tp = ranges, len(ranges), tp
        self.links: PipelineLinks | None = None
        super().__init__(len(ranges) * tp, expert_parallel, device, engine_config, threads)

    def worker_extra(self) -> dict[str, Any]:
        return {"ranges": [list(r) for r in self.ranges], "tp": self.tp}

    def joined(self, backend: str, device: torch.device) -> None:
        self.links = links = pipeline_links(self.stages, self.tp, 0)
        if self.tp > 1:  # the driver is TP rank 0 of stage 0: layers built from now on are its shard
            set_parallel_state(0, self.tp, self.expert_parallel, links.tp_group)
        log.info("pipeline parallel: %d stages%s over %s (%s), layers %s", self.stages,
                 f" of {self.tp} tensor-parallel ranks" if self.tp > 1 else "", backend, device.type,
                 ", ".join(f"{a}-{b - 1}" for a, b in self.ranges))

    def stage_details(self, details: list[Any]) -> list[Any]:
        """Of every worker's answer to a step (by global rank 1..), each later stage's TP rank 0's."""
        return [details[s * self.tp - 1] for s in range(1, self.stages)]


@dataclass
class Flight:
    """A micro-batch on its way through the stages."""

    scheduled: list[ScheduledSeq]
    completes: list[bool]  # per sequence, as launched (an abort meanwhile resets what `completes` reads)
    tag: int
    hidden: torch.Tensor  # stage 0's output, kept alive until its send completes
    sent: Any
    logits: torch.Tensor
    received: Any  # None when the step completes no sequence (a prompt chunk): no logits come back


class PPModelRunner(ModelRunner):
    def __init__(self, model: CausalLM, kv_cache: KVCache, group: PPGroup) -> None:
        super().__init__(model, kv_cache)
        self.group = group
        self.links = group.links
        self.copies: list[PageCopy] = []
        self.tag = 0
        self.busy = [0.0] * group.stages  # per stage: seconds computing, and steps run
        self.steps = [0] * group.stages

    def touch_cache(self) -> int:
        return self.group.run("touch_cache", super().touch_cache)

    def apply_copies(self, copies: list[PageCopy]) -> None:
        self.copies += copies  # they travel with the next step, to every stage

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        raise ConfigError("sparse_kv is not built for pipeline parallelism yet")

    def attach_adapter(self, adapter_id: int, name: str, path: str, max_rank: int | None = None,
                       prepared: PreparedAdapter | None = None) -> LoRAAdapter:
        raise ConfigError("LoRA adapters are not built for pipeline parallelism yet; serve without them or use "
                          "--pipeline-parallel-size 1")

    def launch(self, scheduled: list[ScheduledSeq]) -> Flight:
        import torch.distributed as dist

        assert self.links is not None
        step = prepare_step(scheduled)
        copies, self.copies = self.copies, []
        self.tag += 1
        self.group.send("execute", copies, step, self.tag)
        try:
            start = time.perf_counter()
            with parallel_scope(self.parallel):
                super().apply_copies(copies)
                hidden = self.hidden_states(step).contiguous()
            self.busy[0] += time.perf_counter() - start
            self.steps[0] += 1
            links = self.links
            sent = dist.isend(hidden, dst=links.peer(1), group=links.forward[0], tag=self.tag)
            n = len(step.logit_rows)
            logits = torch.empty(n, self.model.config.vocab_size, dtype=torch.float32, device=self.device)
            received = dist.irecv(logits, src=links.last_rank, group=links.back, tag=self.tag) if n else None
        except EngineDeadError:
            raise
        except Exception as e:
            self.group._dead(f"stage 0 failed a step ({type(e).__name__}: {e})")
        return Flight(scheduled, [s.completes for s in scheduled], self.tag, hidden, sent, logits, received)

    def finish(self, flight: Flight) -> StepOutput:
        # every worker's answer to this step, in step order; of each stage, its TP rank 0's
        details = self.group.stage_details(self.group.collect("execute", None))
        if flight.received is not None:
            flight.received.wait()
        flight.sent.wait()
        for stage, detail in enumerate(details, start=1):
            self.busy[stage] += detail["busy"]
            self.steps[stage] += 1
        return StepOutput(flight.logits, details[-1]["scored"], flight.scheduled)

    def run(self, scheduled: list[ScheduledSeq]) -> StepOutput:
        return self.finish(self.launch(scheduled))

    def run_isolating(self, scheduled: list[ScheduledSeq]) -> StepOutput:
        return self.run(scheduled)  # a failed step ends the engine: nothing to isolate


class Pipeline:
    """The engine's steps under pipeline parallelism: up to `depth` micro-batches in flight."""

    def __init__(self, engine: PipelinedEngine, depth: int) -> None:
        self._engine = weakref.ref(engine)  # the engine holds this: a strong reference back would be a cycle
        self.depth = depth
        self.flights: deque[tuple[SchedulerOutput, Flight]] = deque()
        self.in_flight: set[int] = set()

    @property
    def engine(self) -> PipelinedEngine:
        engine = self._engine()
        assert engine is not None, "the pipeline outlived its engine"
        return engine

    @property
    def runner(self) -> PPModelRunner:
        runner = self.engine.runner
        assert isinstance(runner, PPModelRunner)
        return runner

    def step(self) -> list[RequestOutput]:
        eng = self.engine
        sched = eng.scheduler
        while len(self.flights) < self.depth:
            share = math.ceil((len(sched.running) + len(sched.waiting)) / self.depth) or 1
            try:
                plan = sched.schedule(frozenset(self.in_flight), max_seqs=share)
            except Exception as e:
                return eng.recovery.step_failed(e, sched.running + list(sched.waiting)[:1], eng.abort)
            if not plan.scheduled:
                break
            self.runner.apply_copies(plan.copies)
            self.flights.append((plan, self.runner.launch(plan.scheduled)))
            self.in_flight.update(s.seq.seq_id for s in plan.scheduled)
        if not self.flights:
            if sched.waiting and not sched.running:
                raise CapacityError("no waiting request fits the free KV pages; raise --kv-cache-memory")
            return []
        plan, flight = self.flights.popleft()
        self.in_flight.difference_update(s.seq.seq_id for s in plan.scheduled)
        step = _without_finished(self.runner.finish(flight), flight.completes)  # aborted while in flight
        try:
            outputs = eng._finish_step(step)
        except EngineDeadError:
            raise
        except Exception as e:
            return eng.recovery.step_failed(e, [s.seq for s in step.scheduled], eng.abort)
        eng.recovery.step_succeeded()
        return outputs

    def utilization(self) -> list[tuple[float, int]]:
        """Per stage: (busy seconds, steps run) since the engine started."""
        return list(zip(self.runner.busy, self.runner.steps))


def _without_finished(step: StepOutput, completes: list[bool]) -> StepOutput:
    if not any(s.seq.is_finished for s in step.scheduled):
        return step
    rows, kept, row = [], [], 0
    for s, done in zip(step.scheduled, completes):
        if not s.seq.is_finished:
            kept.append(s)
            if done:
                rows.append(row)
        row += done
    logits = step.logits[torch.tensor(rows, dtype=torch.long)] if rows else step.logits[:0]
    return StepOutput(logits, step.prompt_logprobs, kept, step.failed)


def start_pipeline_parallel(config: EngineConfig, model: CausalLM | None) -> tuple[CausalLM, PPGroup]:
    """(stage 0's part of the model, the group) for an engine config asking for more than one stage."""
    from mlc.config.device import resolve_device
    from mlc.distributed.checks import check_pipeline_parallel, rank_device
    from mlc.engine.launch import current_launcher
    from mlc.engine.pp_stage import cut_to_stage, stage_ranges
    from mlc.models.hf_checkpoint import read_config
    from mlc.models.loader import load_model
    from mlc.models.store import resolve_model_dir

    if model is not None:
        raise ConfigError("pipeline parallelism loads the model in every stage: pass the model's name or path, "
                          "not a model object")
    stages = config.pipeline_parallel_size
    device = resolve_device(config.device)
    cfg = read_config(resolve_model_dir(config.model))
    tp, ep = config.tensor_parallel_size, config.enable_expert_parallel
    check_pipeline_parallel(cfg, stages, config.device, local=not current_launcher().spans_nodes, tp=tp,
                            expert_parallel=ep)
    ranges = stage_ranges(cfg, stages)
    # on a CPU the processes share its cores: each gets its part, or num_threads when set
    threads = config.num_threads or (max(1, (os.cpu_count() or 1) // (stages * tp)) if device.type == "cpu" else 1)
    torch.set_num_threads(threads)
    group = PPGroup(ranges, tp, ep, device, config.model_dump(), threads)
    try:
        model = load_model(config.model, rank_device(device, 0), config.dtype, config.weight_dtype,
                           verify=config.verify)
        model = cut_to_stage(model, ranges[0], first=True, last=False)
    except Exception:
        group.shutdown()
        raise
    group.collect("load", None)
    return model, group
