"""Summary statistics for benchmark samples: mean and percentiles (linear interpolation, numpy's default)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of `values`, interpolating between the two nearest ranks; NaN when empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


@dataclass(frozen=True)
class Summary:
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    def scaled(self, factor: float) -> Summary:
        """The same summary in other units (seconds -> milliseconds: 1000)."""
        return Summary(self.count, *(v * factor for v in (self.mean, self.p50, self.p90, self.p99, self.max)))

    def as_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}


def summarize(values: Sequence[float]) -> Summary:
    return Summary(len(values), mean(values), percentile(values, 50), percentile(values, 90),
                   percentile(values, 99), max(values) if values else math.nan)
