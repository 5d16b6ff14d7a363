"""Where the misses come from, fleet-wide: every pool's sampled split from every collector.

The aggregator side of the miss split (docs/cache-analytics.md, "Where the misses come from").
Each collector's snapshot carries one `MissDelta` per pool it watches ranks of
(sources/miss_stats.py); `MissMerge` queues them in one `SampledSplit` per pool
(analysis/miss_sample.py), applies them in engine-time order up to the earliest point every
live collector has reported (a collector that goes down is waited for no longer), and builds
each pool's `PoolSplit` for a view: the shares since the pool's start with their bound, the
misses per worker and kind as counters (each sampled miss weighed by the inverse of its sample
rate: unbiased, and only growing), the engines' prefix-cache hits, and the last RECENT_S of all
of it (what the conditions and the alert read). It says what it needs back to the collectors
(`feedback`: each pool's level, and full deltas after a loss).

Trust: the bound holds unless a collector of the pool is down (its ranks' changes are not
seen), a rank of the pool is down or partial (its index misses stores or removals), deltas
were lost (until the collector's full delta), or fewer than `floor` sampled misses stand behind
the shares. Pure: `now` is passed in.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from kvobserve.analysis.miss_sample import FLOOR, START_LEVEL, SampledSplit
from kvobserve.analysis.views import KINDS, FleetView, PoolSplit, RecentSplit, WorkerSplit
from kvobserve.wire.misses import MissFeedback
from kvobserve.wire.snapshot import Snapshot

RECENT_S = 900.0  # the window of `PoolSplit.recent` (as analysis/conditions.py RECENT_S)
HISTORY_STEP_S = 10.0  # a pool's counts are noted at most this often for the window
RESYNC_EVERY_S = 10.0  # a full delta is asked of a collector again after this long
REASONS = ("collector_down", "rank_partial", "deltas_lost", "few_samples")


@dataclass
class _Pool:
    split: SampledSplit
    workers: set[str] = field(default_factory=set)
    collectors: set[str] = field(default_factory=set)  # that sent deltas of this pool
    # (time, hit blocks or None, misses by kind) every HISTORY_STEP_S, the last RECENT_S
    history: deque[tuple[float, float | None, tuple[float, ...]]] = field(default_factory=deque)
    asked: dict[str, float] = field(default_factory=dict)  # collector -> when a resync was asked


class MissMerge:
    """Every pool's sampled split; fed each applied snapshot (`add`)."""

    def __init__(self, floor: int = FLOOR, start_level: int = START_LEVEL) -> None:
        self.floor = floor
        self.start_level = start_level
        self.pools: dict[str, _Pool] = {}
        # the engines' prefix-cache counters: (worker, rank; -1 the whole worker) -> (hit
        # tokens, query tokens), and each worker's block size, as the latest snapshots say
        self.prefix: dict[tuple[str, int], tuple[float, float]] = {}
        self.block_size: dict[str, int] = {}
        self.down: set[str] = set()  # collectors known down (waited for no longer)

    def add(self, snap: Snapshot, now: float) -> None:
        """One collector's applied snapshot (part): its deltas, prefix counters, block sizes."""
        info = snap.collector
        cid = info.collector_id
        self.down.discard(cid)
        for p in snap.prefix:
            self.prefix[(p.worker_id, p.dp_rank)] = (p.hit_tokens, p.query_tokens)
        for st in snap.streams:
            if st.block_size:
                self.block_size[st.worker_id] = st.block_size
        touched = []
        for d in snap.misses:
            pool = self.pools.get(d.pool)
            if pool is None:
                pool = self.pools[d.pool] = _Pool(SampledSplit(self.floor, self.start_level))
            self._note(pool, now)  # before: the window starts with the pool
            pool.split.add(cid, d, info.start_time)
            pool.workers.update(w for w, _ in d.rank_keys())
            pool.collectors.add(cid)
            touched.append(pool)
        for pool in touched:
            pool.split.advance()

    def collectors_down(self, ids: set[str]) -> None:
        """Collectors that went down: apply what they sent, wait for them no longer."""
        for cid in ids - self.down:
            for pool in self.pools.values():
                if cid in pool.collectors:
                    pool.split.forget(cid)
                    pool.split.advance()
        self.down |= ids

    def forget(self, collector_id: str) -> None:
        """A collector forgotten by the fleet (silent for an hour): a pool none of whose
        collectors is left goes too, and so does what nothing reports any more."""
        self.down.discard(collector_id)
        for name in list(self.pools):
            pool = self.pools[name]
            pool.collectors.discard(collector_id)
            if not pool.collectors:
                del self.pools[name]
        workers = {w for p in self.pools.values() for w in p.workers}
        self.prefix = {k: v for k, v in self.prefix.items() if k[0] in workers}
        self.block_size = {w: n for w, n in self.block_size.items() if w in workers}

    def feedback(self, now: float) -> MissFeedback:
        """Each pool's level; the full deltas wanted (asked again every RESYNC_EVERY_S)."""
        resync: dict[str, list[str]] = {}
        for name, pool in sorted(self.pools.items()):
            for cid in sorted(pool.split.resync):
                if now - pool.asked.get(cid, -RESYNC_EVERY_S) >= RESYNC_EVERY_S:
                    pool.asked[cid] = now
                    resync.setdefault(cid, []).append(name)
        levels = {name: pool.split.level for name, pool in sorted(self.pools.items())}
        return MissFeedback(levels, resync)

    # --- the view ---------------------------------------------------------------------------

    def _worker(self, pool: _Pool, worker_id: str) -> WorkerSplit:
        misses = [0.0, 0.0, 0.0]
        for (w, _), weighed in pool.split.weighed.items():
            if w == worker_id:
                for k in range(3):
                    misses[k] += weighed[k]
        whole = self.prefix.get((worker_id, -1))
        ranks = [v for (w, r), v in self.prefix.items() if w == worker_id and r >= 0]
        hit: float | None = None
        query: float | None = None
        if whole is not None:
            hit, query = whole
        elif ranks:
            hit, query = sum(h for h, _ in ranks), sum(q for _, q in ranks)
        return WorkerSplit(worker_id, dict(zip(KINDS, misses, strict=True)), hit, query,
                           self.block_size.get(worker_id, 0))  # fmt: skip

    def _hits(self, pool: _Pool) -> float | None:
        """The pool's hit blocks now; None unless every worker reports them."""
        total = 0.0
        for w in pool.workers:
            hb = self._worker(pool, w).hit_blocks
            if hb is None:
                return None
            total += hb
        return total

    def pool_hits(self, name: str) -> float | None:
        """A pool's hit blocks now (the engines' counters); None unless every worker reports
        them (the capacity curve, analysis/capacity_fleet.py)."""
        pool = self.pools.get(name)
        return self._hits(pool) if pool is not None else None

    def _note(self, pool: _Pool, now: float) -> None:
        h = pool.history
        if h and now - h[-1][0] < HISTORY_STEP_S:
            return
        counts = [0.0, 0.0, 0.0]
        for weighed in pool.split.weighed.values():
            for k in range(3):
                counts[k] += weighed[k]
        h.append((now, self._hits(pool), tuple(counts)))
        while len(h) > 2 and now - h[1][0] >= RECENT_S:
            h.popleft()

    def _recent(self, pool: _Pool, workers: tuple[WorkerSplit, ...], now: float) -> RecentSplit:
        """The window: from the oldest note within RECENT_S (or the first) to now."""
        misses = [sum(w.misses[k] for w in workers) for k in KINDS]
        hits = self._hits(pool)
        if not pool.history:
            return RecentSplit(0.0, dict(zip(KINDS, misses, strict=True)), None)
        t0, h0, m0 = pool.history[0]
        for t, h, m in pool.history:
            if now - t <= RECENT_S:
                t0, h0, m0 = t, h, m
                break
        got = [misses[k] - m0[k] for k in range(3)]
        dh = None
        if hits is not None and h0 is not None:
            dh = hits - h0 if hits >= h0 else hits  # the engine restarted: its counters reset
        return RecentSplit(max(0.0, now - t0), dict(zip(KINDS, got, strict=True)), dh)

    def _trust(self, name: str, pool: _Pool, v: FleetView) -> tuple[list[str], list[str]]:
        """(codes, what to say) of what keeps the pool's bound from holding, beside the
        sample's own (lost deltas, few samples)."""
        codes: list[str] = []
        said: list[str] = []
        gone = sorted(c for c in pool.collectors if c in self.down)
        uncovered = sorted(
            f"{w} rank {r}" for (w, r), ids in v.owners.items() if w in pool.workers and not ids
        )
        if gone or uncovered:
            codes.append("collector_down")
            said.append("collector " + ", ".join(gone) + " down" if gone else "")
            if uncovered:
                said.append("no live collector watches " + ", ".join(uncovered[:4]))
        partial = sorted(
            f"{s.stats.worker_id} rank {s.stats.dp_rank}"
            for s in v.streams
            if s.stats.worker_id in pool.workers
            and s.live
            and (not s.stats.up or s.stats.trust == "partial")
        )
        if partial:
            codes.append("rank_partial")
            said.append("down or partial: " + ", ".join(partial[:4]))
        return codes, [x for x in said if x]

    def views(self, v: FleetView) -> dict[str, PoolSplit]:
        """Every pool's split as of the view (its time, streams and owners)."""
        out: dict[str, PoolSplit] = {}
        for name, pool in sorted(self.pools.items()):
            est = pool.split.estimate()
            workers = tuple(self._worker(pool, w) for w in sorted(pool.workers))
            codes, said = self._trust(name, pool, v)
            codes += est.reasons
            if est.reason:
                said.append(est.reason)
            out[name] = PoolSplit(
                name, workers, est.shares, est.bound, est.sampled, est.level, not codes,
                tuple(c for c in REASONS if c in codes), "; ".join(said),
                self._recent(pool, workers, v.now),
                pool.split.watermark if pool.split.watermark > -math.inf else None,
            )  # fmt: skip
        return out
