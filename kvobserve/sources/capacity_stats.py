"""The capacity curves of the ingest thread's streams: one `RankCurve` per rank, shipped slowly.

Runs in the ingest thread (like `miss_stats`): a stream of an engine whose eviction follows
recency (its profile's `recency_eviction`) gets a `RankCurve` (analysis/capacity.py), fed from
its pool's miss sampler's pass over each applied batch (the rank's `RankTap`). Every
`CurveOptions.interval_s` a snapshot carries every curve (`RankCurveStats`, wire/capacity.py);
in between none (the aggregator keeps the last ones). docs/cache-analytics.md, "What more
memory would buy".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvobserve.analysis.capacity import CurveOptions, RankCurve
from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.engines import profile
from kvobserve.sources.miss_stats import pool_of
from kvobserve.wire.capacity import RankCurveStats


@dataclass(frozen=True, slots=True)
class WorkerCurve:
    """What a [[worker]] says about its ranks' curves."""

    capacity_tokens: int = 0  # configured; 0: the rank's high-water mark is the basis
    below: bool = False  # opt-in: the points below the capacity


class RankCurves:
    """Every followed rank's curve in this collector."""

    def __init__(self, options: CurveOptions, workers: Mapping[str, WorkerCurve]) -> None:
        self.options = options
        self.workers = dict(workers)  # [[worker]] id -> its settings
        self.curves: dict[tuple[str, int], RankCurve] = {}
        self._last: float | None = None  # when the curves last shipped (the ingest clock)

    def make(
        self, worker_id: str, dp_rank: int, engine: str, seq: StreamSequencer
    ) -> RankCurve | None:
        """The curve of a new stream; None for an engine whose eviction is not recency-ordered
        (the aggregator says so instead of a number)."""
        p = profile(engine)
        if not p.recency_eviction:
            return None
        w = self.workers.get(pool_of({k: k for k in self.workers}, worker_id)) or WorkerCurve()
        curve = RankCurve(
            self.options, signed=p.signed_hashes, capacity_tokens=w.capacity_tokens,
            below=w.below, index=seq.index,
        )  # fmt: skip
        self.curves[(worker_id, dp_rank)] = curve
        return curve

    def drop(self, worker_id: str, dp_rank: int) -> None:
        """A stream no longer watched: its curve goes (the aggregator keeps what it got)."""
        self.curves.pop((worker_id, dp_rank), None)

    def stats(self, now: float) -> list[RankCurveStats]:
        """Every curve, once per interval (`now`: the ingest thread's monotonic clock); empty
        in between."""
        if self._last is not None and now - self._last < self.options.interval_s:
            return []
        self._last = now
        return [c.stats(w, r) for (w, r), c in sorted(self.curves.items())]
