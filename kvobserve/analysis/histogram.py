"""A Prometheus-style histogram of durations: per-bucket counts, sum and count.

Block lifetimes (analysis/blocks.py) and removal-to-restore gaps (analysis/thrash.py) are counted
in one; sources/cache_stats.py turns it into the snapshot's cumulative `Histogram`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence


class LifetimeHistogram:
    """Per-bucket counts of durations in seconds (upper bounds `buckets`, then +Inf)."""

    __slots__ = ("_counts", "buckets", "count", "sum")

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets: tuple[float, ...] = tuple(buckets)
        self._counts = [0] * (len(self.buckets) + 1)  # last slot is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        """Add `n` observations of `value` (negative values count as 0)."""
        if value < 0.0:
            value = 0.0
        self._counts[bisect_left(self.buckets, value)] += n
        self.sum += value * n
        self.count += n

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, cumulative count) pairs, ending with (+Inf, count)."""
        out: list[tuple[float, int]] = []
        acc = 0
        for bound, n in zip((*self.buckets, float("inf")), self._counts, strict=True):
            acc += n
            out.append((bound, acc))
        return out
