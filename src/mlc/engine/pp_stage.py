"""One pipeline stage of a model: which layers it owns, and the model cut down to them.

The layers split into contiguous stages, as evenly as they go with the remainder to the first stages (the first
stage also embeds and the last also runs the final norm and the head, a small share next to a layer). A stage may
only begin where no state but the hidden states crosses from the layer before: for GLM-5 (MLA + DSA) that is a
"full" indexer layer, since a "shared" one reuses the top-k selection of the full layer before it; a boundary that
falls on a shared layer moves down to the next full one.

A stage's model is the whole model's class with the other layers dropped (the models' own forward runs unchanged):
a stage after the first gets its input from the stage before in place of the embedding (`StageInput`), and a stage
before the last returns the hidden states the last layer left, not normed. Its KV cache holds only its own layers,
every group each of them has (MLA latents, DSA indexer keys).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mlc.errors import ConfigError
from mlc.models.base import CausalLM


def stage_starts_allowed(cfg: Any) -> list[bool]:
    """Per layer: whether a stage may begin there (only the hidden states cross into it)."""
    types = getattr(cfg, "indexer_types", None)
    if getattr(cfg, "model_type", "") == "glm_moe_dsa" and types:
        return [t == "full" for t in types]
    return [True] * cfg.num_hidden_layers


def split_layers(num_layers: int, stages: int, allowed: list[bool] | None = None) -> list[tuple[int, int]]:
    """[first, end) layer range of each stage; raises ConfigError when the layers cannot give every stage one."""
    if stages < 1:
        raise ConfigError(f"pipeline_parallel_size must be >= 1, got {stages}")
    if stages > num_layers:
        raise ConfigError(f"pipeline_parallel_size {stages} is more than the model's {num_layers} layers; use "
                          f"--pipeline-parallel-size {num_layers} or less")
    allowed = allowed or [True] * num_layers
    base, extra = divmod(num_layers, stages)
    starts, at = [0], 0
    for s in range(stages - 1):
        at += base + (1 if s < extra else 0)
        start = max(at, starts[-1] + 1)
        while start < num_layers and not allowed[start]:
            start += 1  # a shared-indexer layer needs the full layer before it in the same stage
        if start >= num_layers:
            ok = sum(allowed[1:]) + 1
            raise ConfigError(f"this model's layers cannot make {stages} pipeline stages (a stage must begin at a "
                              f"layer that keeps no state from the one before; {ok} stages at most): use "
                              f"--pipeline-parallel-size {ok} or less")
        starts.append(start)
        at = start
    ends = starts[1:] + [num_layers]
    return list(zip(starts, ends))


def stage_ranges(cfg: Any, stages: int) -> list[tuple[int, int]]:
    return split_layers(cfg.num_hidden_layers, stages, stage_starts_allowed(cfg))


class StageInput(nn.Module):
    """Stands in for the embedding on a stage after the first: returns the hidden states the stage before sent
    (set in `pending` just before the forward), and says the dtype and device the embedding said."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self._dtype, self._device = dtype, device
        self.pending: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, self.pending = self.pending, None
        if h is None or h.shape[0] != ids.shape[0]:
            raise RuntimeError("a pipeline stage ran without the hidden states of the stage before it")
        return h


def cut_to_stage(model: CausalLM, layers: tuple[int, int], first: bool, last: bool) -> CausalLM:
    """`model` keeping only the layers in `layers` (and the embedding where `first`, the norm and head where
    `last`); the dropped weights are freed. Its `stage_layers` says which layers its KV cache holds."""
    dtype, device = model.dtype, model.device
    a, b = layers
    model.model.layers = nn.ModuleList(list(model.model.layers)[a:b])
    if not first:
        model.model.embed_tokens = StageInput(dtype, device)  # type: ignore[assignment]
    if not last:
        model.model.norm = nn.Identity()
        model.lm_head = nn.Identity()
    model.stage_layers = (a, b)
    model.modules_changed()  # fused decode plans are built for the layers it holds
    return model


def stage_input(model: CausalLM) -> StageInput | None:
    embed = model.model.embed_tokens
    return embed if isinstance(embed, StageInput) else None
