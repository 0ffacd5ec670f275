"""The point-to-point links of a pipeline-parallel group: stage i sends its hidden states to stage i+1, and the last
stage sends the logits back to the driver (stage 0). Each link is a group of its own, so that on devices (nccl,
hccl, where a communicator runs its operations in order) the logits coming back never queue behind hidden states
going out; on a CPU (gloo) each is its own pair of sockets. Every rank builds them, in the same order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class PipelineLinks:
    forward: list[Any]  # forward[i]: the group of stages i and i+1
    back: Any  # the group of the last stage and the driver


def pipeline_links(size: int) -> PipelineLinks:
    import torch.distributed as dist

    forward = [dist.new_group([i, i + 1]) for i in range(size - 1)]
    return PipelineLinks(forward, dist.new_group([0, size - 1]))
