"""Where one checkpoint tensor goes when a model loads it: the answer a layer's or a model's name mapping gives."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: a parameter, a shard of a MergedLinear, or a slice of a stacked
    parameter (`expert` picks the first index, `rows` a `[start, stop)` range of the next)."""

    param: str
    shard: int | None = None
    expert: int | None = None
    rows: tuple[int, int] | None = None
