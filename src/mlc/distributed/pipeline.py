"""The process groups of a pipeline-parallel engine with `tp` tensor-parallel ranks in each stage.

Global rank g is tensor-parallel rank g % tp of stage g // tp; the driver is rank 0 (stage 0, TP rank 0). Every rank
of a stage holds the whole hidden state after its layers (the row-parallel outputs are summed inside the stage), so
TP rank j of stage i sends it to TP rank j of stage i+1: a link (a two-rank group) per pair, and no broadcast inside
the receiving stage. The last stage's TP rank 0 sends the logits (gathered over its stage) back to the driver on a
link of its own, so that on devices (nccl, hccl, where a communicator runs its operations in order) the logits
coming back never queue behind hidden states going out; on a CPU (gloo) each link is its own pair of sockets. Each
stage with more than one rank has its tensor-parallel group. Every rank builds every group, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class PipelineLinks:
    stages: int
    tp: int
    rank: int  # this process's global rank
    forward: list[Any]  # forward[i]: this rank's link from stage i to stage i+1 (its own TP rank's pair)
    back: Any  # the link of the last stage's TP rank 0 and the driver
    tp_group: Any  # this rank's stage's tensor-parallel group (None with one rank a stage)

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    def peer(self, stage: int) -> int:
        """The global rank of this rank's TP peer in `stage`."""
        return stage * self.tp + self.tp_rank

    @property
    def last_rank(self) -> int:
        """The global rank that sends the logits back (the last stage's TP rank 0)."""
        return (self.stages - 1) * self.tp


def pipeline_links(stages: int, tp: int, rank: int) -> PipelineLinks:
    import torch.distributed as dist

    j = rank % tp
    forward = []
    for i in range(stages - 1):
        pairs = [dist.new_group([i * tp + k, (i + 1) * tp + k]) for k in range(tp)]
        forward.append(pairs[j])
    back = dist.new_group([0, (stages - 1) * tp])
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(stages)] if tp > 1 else None
    return PipelineLinks(stages, tp, rank, forward, back, groups[rank // tp] if groups else None)
