"""The miss split's samplers of the ingest thread: one per pool, its deltas in every snapshot.

Runs in the ingest thread (like `cache_stats`): each stream's sequencer gets a tap of its pool's
`MissSampler` (analysis/miss_sample.py), which sees every batch the sequencer applies and every
reset, in order. Every snapshot carries one `MissDelta` per pool of this collector (an empty one
too: its `until` lets the aggregator apply the other collectors' changes up to then), and a full
delta of each pool the aggregator asked to resync (`MissFeedback`). docs/cache-analytics.md,
"Where the misses come from".
"""

from __future__ import annotations

from collections.abc import Mapping

from kvobserve.analysis.capacity import RankCurve
from kvobserve.analysis.miss_sample import FLOOR, MissSampler, Rank
from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.engines import profile
from kvobserve.wire.misses import MissDelta, MissFeedback

# A delta covers every batch of engine time up to this long before the collector's clock: a
# batch applied later than this after it was made arrives out of order at the aggregator
# (counted there as a late op, still classified).
UNTIL_SLACK_S = 2.0


def pool_of(pools: Mapping[str, str], worker_id: str) -> str:
    """The pool of a stream's worker: its [[worker]]'s `pool`; a pod's (`{id}/{pod}`, a topic
    template or a Kubernetes selector) is its [[worker]]'s; a worker not configured: itself."""
    got = pools.get(worker_id)
    if got is not None:
        return got
    head = worker_id
    while "/" in head:
        head = head.rpartition("/")[0]
        got = pools.get(head)
        if got is not None:
            return got
    return worker_id


class MissSamplers:
    """Every pool's sampler of this collector's streams."""

    def __init__(self, pools: Mapping[str, str], floor: int = FLOOR) -> None:
        self.pools = dict(pools)  # [[worker]] id -> its pool
        self.floor = floor
        self.samplers: dict[str, MissSampler] = {}
        self._streams: dict[str, dict[Rank, StreamSequencer]] = {}  # pool -> its ranks here
        self._resync: set[str] = set()  # pools the aggregator asked a full delta of

    def attach(
        self, worker_id: str, dp_rank: int, engine: str, seq: StreamSequencer,
        curve: RankCurve | None = None,
    ) -> None:  # fmt: skip
        """Give a stream's sequencer the tap of its pool's sampler (and the rank's capacity
        curve, fed from the same pass: sources/capacity_stats.py)."""
        pool = pool_of(self.pools, worker_id)
        s = self.samplers.get(pool)
        if s is None:
            s = self.samplers[pool] = MissSampler(pool, profile(engine).signed_hashes, self.floor)
        rank = (worker_id, dp_rank)
        seq.tap = s.tap(rank, curve)
        self._streams.setdefault(pool, {})[rank] = seq

    def detach(self, worker_id: str, dp_rank: int, seq: StreamSequencer) -> None:
        """A stream is no longer watched: its sequencer no longer feeds the sampler."""
        seq.tap = None
        pool = pool_of(self.pools, worker_id)
        ranks = self._streams.get(pool, {})
        if ranks.get((worker_id, dp_rank)) is seq:
            del ranks[(worker_id, dp_rank)]

    def follow(self, fb: MissFeedback, collector_id: str) -> None:
        """The aggregator's levels, and the pools it wants resynced by this collector."""
        for pool, level in fb.levels.items():
            s = self.samplers.get(pool)
            if s is not None:
                s.follow(level)
        self._resync.update(p for p in fb.resync.get(collector_id, ()) if p in self.samplers)

    def deltas(self, until: float) -> list[MissDelta]:
        """One delta per pool (the changes since the last one), then a full one of each pool
        the aggregator asked for."""
        out = [s.delta(until) for _, s in sorted(self.samplers.items())]
        for pool in sorted(self._resync):
            ranks = self._streams.get(pool, {})
            residents: dict[Rank | int, list[object]] = {
                r: list(seq.index.top_resident()) for r, seq in sorted(ranks.items())
            }
            out.append(self.samplers[pool].full(residents, until))  # type: ignore[arg-type]
        self._resync.clear()
        return out
