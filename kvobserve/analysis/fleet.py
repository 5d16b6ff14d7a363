"""Fleet state across collectors: latest snapshot each, staleness, DP-rank ownership, conditions.

Pure: the caller passes `now` (wall-clock seconds, the same clock as `Snapshot.time`).
A collector silent for `stale_intervals` of its own interval is down: it owns nothing, it is
no scheduler leader, and its streams are served as down (stale), never as live.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvobserve.analysis.placement import PlacementEstimate, merge_placement
from kvobserve.wire.snapshot import (
    CollectorInfo,
    SchedulerStats,
    Snapshot,
    StreamStats,
    UnexpectedStream,
    WorkerPlacement,
)

GPU_MEDIA = frozenset({"GPU", "DEVICE"})


@dataclass(frozen=True)
class Condition:
    """An active problem, as shown on the status page and in /api/v1/alerts."""

    kind: str  # duplicate_stream, unexpected_stream, dp_rank_uncovered, ...
    severity: str  # critical, warning, info
    labels: tuple[tuple[str, str], ...]
    description: str

    @property
    def key(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """Identity of the condition across views (for transitions)."""
        return (self.kind, self.labels)


@dataclass(frozen=True)
class CollectorView:
    """One collector as the fleet sees it."""

    info: CollectorInfo
    up: bool
    age_s: float  # seconds since its last snapshot arrived
    snapshot: Snapshot


@dataclass(frozen=True)
class StreamView:
    """One stream with its collector, liveness and derived usage."""

    stats: StreamStats
    collector: CollectorInfo
    live: bool  # collector up; a stale stream is served as down
    capacity_tokens: float | None
    gpu_tokens: int

    @property
    def up(self) -> bool:
        """Connected, healthy and not stale."""
        return self.live and self.stats.up

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


@dataclass
class FleetView:
    """Everything the exporters render, computed once per scrape."""

    collectors: list[CollectorView] = field(default_factory=list)
    streams: list[StreamView] = field(default_factory=list)
    unexpected: list[tuple[UnexpectedStream, CollectorInfo]] = field(default_factory=list)
    scheduler: list[tuple[SchedulerStats, CollectorInfo]] = field(default_factory=list)
    dp_size: dict[str, int] = field(default_factory=dict)
    owners: dict[tuple[str, int], list[str]] = field(default_factory=dict)  # -> collector ids
    leaders: dict[str, list[str]] = field(default_factory=dict)
    conditions: list[Condition] = field(default_factory=list)
    placement: dict[str, PlacementEstimate] = field(default_factory=dict)  # per worker


@dataclass
class _Entry:
    snapshot: Snapshot
    received: float


class FleetState:
    """The latest snapshot per collector and the fleet view derived from them."""

    def __init__(self, stale_intervals: float = 3.0, forget_after_s: float = 3600.0) -> None:
        self.stale_intervals = stale_intervals
        self.forget_after_s = forget_after_s
        self._entries: dict[str, _Entry] = {}
        self.snapshots_applied = 0
        self.snapshots_ignored = 0  # older than the one we have (reordered or replayed)

    def update(self, snap: Snapshot, now: float) -> bool:
        """Keep `snap` if it is newer than what we have for its collector."""
        cid = snap.collector.collector_id
        old = self._entries.get(cid)
        if old is not None:
            o = old.snapshot
            same_process = o.collector.start_time == snap.collector.start_time
            if same_process and snap.seq <= o.seq:
                self.snapshots_ignored += 1
                return False
            if not same_process and snap.collector.start_time < o.collector.start_time:
                self.snapshots_ignored += 1
                return False
        self._entries[cid] = _Entry(snap, now)
        self.snapshots_applied += 1
        return True

    def collector_ids(self) -> list[str]:
        """Ids of every collector we hold a snapshot for."""
        return sorted(self._entries)

    def _is_up(self, e: _Entry, now: float) -> bool:
        return now - e.received <= self.stale_intervals * max(e.snapshot.interval_s, 0.001)

    def view(self, now: float) -> FleetView:
        """The fleet as of `now`."""
        for cid in [c for c, e in self._entries.items() if now - e.received > self.forget_after_s]:
            del self._entries[cid]
        v = FleetView()
        entries = sorted(self._entries.values(), key=lambda e: e.snapshot.collector.collector_id)
        capacity: dict[tuple[str, int], float] = {}
        configured: dict[tuple[str, str], int] = {}
        for e in entries:
            snap, up = e.snapshot, self._is_up(e, now)
            info = snap.collector
            v.collectors.append(CollectorView(info, up, max(0.0, now - e.received), snap))
            for w in snap.workers:
                v.dp_size[w.worker_id] = max(v.dp_size.get(w.worker_id, 0), w.dp_size)
                v.leaders.setdefault(w.worker_id, [])
                configured[(info.collector_id, w.worker_id)] = w.capacity_tokens
                if not up:
                    continue
                for r in w.ranks_owned:
                    v.owners.setdefault((w.worker_id, r), []).append(info.collector_id)
                if w.leader:
                    v.leaders[w.worker_id].append(info.collector_id)
            if up:
                for s in snap.scheduler:
                    v.scheduler.append((s, info))
                    if s.max_total_tokens:
                        capacity[(s.worker_id, s.dp_rank)] = s.max_total_tokens
        for w_id, size in v.dp_size.items():
            for r in range(size):
                v.owners.setdefault((w_id, r), [])
        for e in entries:
            snap, up = e.snapshot, self._is_up(e, now)
            info = snap.collector
            for st in snap.streams:
                cap: float | None = configured.get((info.collector_id, st.worker_id)) or None
                if cap is None:
                    cap = capacity.get((st.worker_id, st.dp_rank))
                gpu = sum(m.tokens for m in st.media if m.medium in GPU_MEDIA)
                v.streams.append(StreamView(st, info, up, cap, gpu))
            if up:
                v.unexpected.extend((u, info) for u in snap.unexpected)
        v.streams.sort(key=lambda s: (s.stats.worker_id, s.stats.dp_rank, s.collector.collector_id))
        placements: dict[str, list[WorkerPlacement]] = {}
        for e in entries:
            if self._is_up(e, now):
                for p in e.snapshot.placement:
                    placements.setdefault(p.worker_id, []).append(p)
        v.placement = {w: merge_placement(ps) for w, ps in sorted(placements.items())}
        v.conditions = list(_conditions(v))
        return v


def _labels(**kw: object) -> tuple[tuple[str, str], ...]:
    return tuple((k, str(val)) for k, val in kw.items())


def _conditions(v: FleetView) -> Iterable[Condition]:
    for c in v.collectors:
        if not c.up:
            yield Condition(
                "collector_down",
                "critical",
                _labels(collector=c.info.collector_id, node_rank=c.info.node_rank),
                f"collector {c.info.collector_id} silent for {c.age_s:.0f} s",
            )
    for (w, r), ids in sorted(v.owners.items()):
        if not ids:
            yield Condition(
                "dp_rank_uncovered",
                "critical",
                _labels(worker_id=w, dp_rank=r),
                f"{w} rank {r} is watched by no live collector",
            )
        elif len(ids) > 1:
            yield Condition(
                "dp_rank_multiple_owners",
                "warning",
                _labels(worker_id=w, dp_rank=r),
                f"{w} rank {r} is owned by {len(ids)} collectors: {', '.join(ids)}",
            )
    for w, ids in sorted(v.leaders.items()):
        if len(ids) > 1:
            yield Condition(
                "multiple_scheduler_leaders",
                "warning",
                _labels(worker_id=w),
                f"{w} has {len(ids)} scheduler-metrics leaders: {', '.join(ids)}",
            )
    for s in v.streams:
        st = s.stats
        where = _labels(worker_id=st.worker_id, node_rank=s.collector.node_rank, dp_rank=st.dp_rank)
        if not s.up:
            yield Condition(
                "stream_down", "critical", where, f"{st.worker_id} rank {st.dp_rank} is down"
            )
            continue
        if st.duplicate_stream:
            yield Condition(
                "duplicate_stream",
                "critical",
                where,
                f"{st.worker_id} rank {st.dp_rank}: two publishers (interleaved or mirrored)",
            )
        if not st.state_complete:
            yield Condition(
                "index_incomplete",
                "warning",
                where,
                f"{st.worker_id} rank {st.dp_rank}: block index incomplete ({st.lost} batches lost)",
            )
    for u, info in v.unexpected:
        if u.active:
            yield Condition(
                "unexpected_stream",
                "warning",
                _labels(worker_id=u.worker_id, node_rank=info.node_rank, endpoint=u.endpoint),
                f"{u.worker_id}: events on {u.endpoint}, past the last rank",
            )
