"""The fleet as the exporters and the conditions read it: one view per scrape or check.

Built by `FleetState` (analysis/fleet.py) from the collectors' latest snapshots; read by
analysis/conditions.py (what is wrong now) and the export layer (/metrics, the API, the page).
Pure data: nothing here computes beyond a stream's usage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from msgspec import Struct

from kvobserve.analysis.capacity import RankDeltas, WorkerDeltas
from kvobserve.analysis.capacity_pool import PoolDeltas
from kvobserve.analysis.placement import PlacementEstimate
from kvobserve.wire.snapshot import (
    CollectorInfo,
    SchedulerStats,
    Snapshot,
    SourceState,
    StreamStats,
    UnexpectedStream,
    WorkerInfo,
)

Labels = tuple[tuple[str, str], ...]  # a condition's labels, in order
Key = tuple[str, Labels]  # a condition's identity across views: (kind, labels)


@dataclass(frozen=True, slots=True)
class CollectorView:
    """One collector as the fleet sees it."""

    info: CollectorInfo
    up: bool
    age_s: float  # seconds since its last snapshot arrived
    snapshot: Snapshot
    serial: int  # a number of its own for each snapshot the fleet state serves (never reused)


class StreamView(Struct, frozen=True, gc=False):
    """One stream with its collector, liveness and derived usage (a Struct: one view per stream
    per scrape, built at C speed)."""

    stats: StreamStats
    collector: CollectorInfo
    live: bool  # collector up; a stale stream is served as down
    capacity_tokens: float | None
    gpu_tokens: int
    scheduler_source: str | None = None  # the scheduler sources of this rank; None: none has it
    collector_last_seen: float = 0.0  # the time of its collector's last snapshot

    @property
    def up(self) -> bool:
        """Connected, healthy and not stale."""
        return self.live and self.stats.up

    @property
    def view_trust(self) -> str:
        """The trust state of its view now: `unknown` while it is not up (nothing it holds is
        known now), else the stream's (docs/cache-analytics.md; "" from older collectors)."""
        return self.stats.trust if self.live and self.stats.up else "unknown"

    @property
    def usage_ratio(self) -> float | None:
        """GPU-tier resident tokens / capacity, when the capacity is known."""
        if not self.capacity_tokens:
            return None
        return self.gpu_tokens / self.capacity_tokens

    @property
    def over_capacity(self) -> bool:
        """More GPU tokens resident than the rank can hold: evidence of lost removals (the
        check lives here, where the scheduler's capacity is known; docs/cache-analytics.md)."""
        return bool(self.capacity_tokens) and self.gpu_tokens > (self.capacity_tokens or 0)


KINDS = ("compulsory", "capacity", "placement")  # the kinds of a miss (analysis/misses.py)


@dataclass(frozen=True, slots=True)
class WorkerSplit:
    """One worker's part of its pool's miss split (blocks are the engine's pages)."""

    worker_id: str
    misses: dict[str, float]  # kind -> blocks: each sampled miss weighed by 1 / its sample rate
    hit_tokens: float | None  # the engine's prefix-cache hits (cumulative); None: not reported
    query_tokens: float | None  # ... and what was looked up
    block_size: int  # tokens per block of its events; 0: unknown (no store yet)

    @property
    def hit_blocks(self) -> float | None:
        """Hits in blocks (hit tokens / block size), where both are known."""
        if self.hit_tokens is None or not self.block_size:
            return None
        return self.hit_tokens / self.block_size


@dataclass(frozen=True, slots=True)
class RecentSplit:
    """A pool's lookups over the last `seconds` (the window of the conditions and alerts)."""

    seconds: float
    misses: dict[str, float]  # kind -> blocks
    hits: float | None  # blocks; None: not reported by every worker

    @property
    def total_misses(self) -> float:
        """Every miss of the window."""
        return sum(self.misses.values())

    def share(self, kind: str) -> float | None:
        """The kind's share of the window's misses (None: none)."""
        total = self.total_misses
        return self.misses[kind] / total if total else None


@dataclass(frozen=True, slots=True)
class PoolSplit:
    """Where a pool's misses come from (analysis/miss_fleet.py), as the sample says."""

    pool: str
    workers: tuple[WorkerSplit, ...]
    shares: dict[str, float]  # kind -> share of the misses since the pool's start
    bound: float  # 99 % half-width of the widest share (over draws of the sample: see BOUND_Z)
    sampled: int  # sampled misses behind the shares
    level: int  # the sample holds 2^-level of the blocks
    trusted: bool  # the bound holds (else `reasons`)
    reasons: tuple[str, ...]  # collector_down, rank_partial, deltas_lost, few_samples
    reason: str  # one line for a person
    recent: RecentSplit | None = None
    as_of: float | None = None  # engine time every collector's changes are applied up to

    def misses(self) -> dict[str, float]:
        """Kind -> blocks, summed over the workers."""
        return {k: sum(w.misses[k] for w in self.workers) for k in KINDS}


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """One point of a capacity curve (docs/cache-analytics.md "What more memory would buy")."""

    factor: float  # of the measured capacity (math.inf: unlimited)
    hit_rate: float | None  # None: not known (`rests_on` says why)
    trusted: bool  # the point's validity and its source's trust hold
    rests_on: str  # what the number rests on, for a person
    capacity_tokens: float | None = None
    capacity_bytes: float | None = None  # where the KV bytes per token are known
    low: float | None = None  # below 1: the band (requests that stored nothing are not seen)
    high: float | None = None
    # validity above 1: the evictions seen since the start, a clear, reset or resync, and those
    # the point needs ((factor - 1) x C), both in capacities; None where it needs none
    evicted: float | None = None
    needs: float | None = None


@dataclass(frozen=True, slots=True)
class TierWorth:
    """What an offload tier adds to a worker's hit rate (the lower tier it has, or one of a
    size asked about: it takes the top tier's evictions and promotes on hit)."""

    medium: str = ""  # the lower tier it has ("": none)
    onboarded: float = 0.0  # blocks loaded back up from it, since observed
    adds: float | None = None  # onboarded / lookups: what it adds today
    hierarchy: float | None = None  # the hit rate of top tier and lower tier together today
    whatif_tokens: int = 0  # per rank: a tier of this many tokens ([worker] tier_tokens, the API)
    whatif_adds: float | None = None  # the curve at 1 + tokens / C, less the measured point


@dataclass(frozen=True)
class CapacityCurve:
    """The hit rate a pool, worker or rank would have had with more (or less) KV memory."""

    scope: str  # pool, worker or rank
    pool: str
    worker_id: str = ""
    dp_rank: int | None = None
    # global: the pool as one cache of its total size (any routing); observed: each rank with
    # its own memory scaled, for the routing that was observed (never a pool's what-if)
    routing: str = "observed"
    available: bool = True  # False: `reason` says why there is no curve
    reason: str = ""  # why not available, or what keeps it from being trusted
    points: tuple[CurvePoint, ...] = ()
    measured: float | None = None  # the hit rate the engines report now (per-rank caches)
    lookups: float = 0.0  # blocks looked up since observed
    capacity_tokens: float | None = None  # factor 1: the rank's, or the pool's total
    block_size: int = 0
    trusted: bool = False
    reasons: tuple[str, ...] = ()  # collector_down, rank_partial, deltas_lost, few_samples, ...
    tier: TierWorth | None = None
    estimate: RankDeltas | WorkerDeltas | PoolDeltas | None = None  # any factor (the API's)

    def point(self, factor: float) -> CurvePoint | None:
        """The point at `factor`, if the curve has it."""
        return next((p for p in self.points if p.factor == factor), None)


@dataclass(frozen=True)
class PoolCapacity:
    """A pool's capacity curves: as one global cache, and per worker and rank as routed."""

    pool: CapacityCurve
    workers: tuple[CapacityCurve, ...] = ()
    ranks: tuple[CapacityCurve, ...] = ()


@dataclass
class FleetView:
    """Everything the exporters render, computed once per scrape; its conditions are
    analysis/conditions.py `active(view)`, worked out only when asked for (/metrics never is)."""

    collectors: list[CollectorView] = field(default_factory=list)
    streams: list[StreamView] = field(default_factory=list)
    unexpected: list[tuple[UnexpectedStream, CollectorInfo]] = field(default_factory=list)
    scheduler: list[tuple[SchedulerStats, CollectorInfo]] = field(default_factory=list)
    dp_size: dict[str, int] = field(default_factory=dict)
    owners: dict[tuple[str, int], list[str]] = field(default_factory=dict)  # -> collector ids
    leaders: dict[str, list[str]] = field(default_factory=dict)
    now: float = 0.0  # the time the view is as of
    # index_incomplete: a rank's index unvouched this long is a warning ([aggregator])
    unvouched_warn_s: float = 600.0
    placement: dict[str, PlacementEstimate] = field(default_factory=dict)  # per worker
    # an uncovered rank -> the down collector that owned it at its last snapshot (the latest)
    last_owner: dict[tuple[str, int], CollectorView] = field(default_factory=dict)
    # an uncovered rank -> since when no live collector has owned it, as the fleet state saw it
    uncovered_since: dict[tuple[str, int], float] = field(default_factory=dict)
    # when each condition was first active, as the aggregator remembers it (analysis/conditions)
    began: dict[Key, float] = field(default_factory=dict)
    # what live collectors say about each worker they are configured with, and their scheduler
    # sources (states and reasons; docs/collector.md)
    workers: list[tuple[WorkerInfo, CollectorInfo]] = field(default_factory=list)
    sources: list[tuple[SourceState, CollectorInfo]] = field(default_factory=list)
    misses: dict[str, PoolSplit] = field(default_factory=dict)  # per pool: the miss split
    capacity: dict[str, PoolCapacity] = field(default_factory=dict)  # per pool: the curves
