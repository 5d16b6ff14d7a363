"""Fleet state across collectors: latest snapshot each, staleness, DP-rank ownership, conditions.

Pure: the caller passes `now` (wall-clock seconds, the same clock as `Snapshot.time`).
A collector silent for `stale_intervals` of its own interval is down: it owns nothing, it is
no scheduler leader, and its streams are served as down (stale), never as live.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvobserve.analysis.conditions import Condition, conditions
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
    scheduler_source: str | None = None  # the scheduler sources of this rank; None: none has it
    collector_last_seen: float = 0.0  # the time of its collector's last snapshot

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
    now: float = 0.0  # the time the view is as of
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
        v = FleetView(now=now)
        entries = sorted(self._entries.values(), key=lambda e: e.snapshot.collector.collector_id)
        capacity: dict[tuple[str, int], float] = {}
        configured: dict[tuple[str, str], int] = {}
        reported: dict[tuple[str, int], list[tuple[SchedulerStats, CollectorInfo]]] = {}
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
                    reported.setdefault((s.worker_id, s.dp_rank), []).append((s, info))
        for w_id, size in v.dp_size.items():
            for r in range(size):
                v.owners.setdefault((w_id, r), [])
        sources = self._join_scheduler(v, reported, capacity)
        for e in entries:
            snap, up = e.snapshot, self._is_up(e, now)
            info = snap.collector
            for st in snap.streams:
                cap: float | None = configured.get((info.collector_id, st.worker_id)) or None
                if cap is None:
                    cap = capacity.get((st.worker_id, st.dp_rank))
                gpu = sum(m.tokens for m in st.media if m.medium in GPU_MEDIA)
                src = sources.get((st.worker_id, st.dp_rank))
                v.streams.append(StreamView(st, info, up, cap, gpu, src, snap.time))
            if up:
                v.unexpected.extend((u, info) for u in snap.unexpected)
        v.streams.sort(key=lambda s: (s.stats.worker_id, s.stats.dp_rank, s.collector.collector_id))
        placements: dict[str, list[WorkerPlacement]] = {}
        for e in entries:
            if self._is_up(e, now):
                for p in e.snapshot.placement:
                    placements.setdefault(p.worker_id, []).append(p)
        v.placement = {w: merge_placement(ps) for w, ps in sorted(placements.items())}
        v.conditions = list(conditions(v))
        return v

    @staticmethod
    def _join_scheduler(
        v: FleetView,
        reported: dict[tuple[str, int], list[tuple[SchedulerStats, CollectorInfo]]],
        capacity: dict[tuple[str, int], float],
    ) -> dict[tuple[str, int], str]:
        """One scheduler entry per (worker_id, dp_rank), whoever read it, under the rank's owner.

        The leader reads worker-wide sources, every node its own ranks' channels: the same rank
        can come from two collectors. Per field the freshest value wins; the entry is served
        with the node_rank of the collector that owns the rank (the reader's when none does).
        Returns (worker_id, dp_rank) -> the sources that reported it.
        """
        infos = {c.info.collector_id: c.info for c in v.collectors if c.up}
        names: dict[tuple[str, int], str] = {}
        for key, got in reported.items():
            stats = got[0][0] if len(got) == 1 else _merge([s for s, _ in got])
            owner = next((infos[c] for c in v.owners.get(key, []) if c in infos), got[0][1])
            v.scheduler.append((stats, owner))
            if stats.max_total_tokens:
                capacity[key] = stats.max_total_tokens
            names[key] = "+".join(sorted({n for s, _ in got for n in s.source.split("+") if n}))
        return names


_STAT_FIELDS = (
    "running_requests",
    "queued_requests",
    "token_usage_ratio",
    "cache_hit_ratio",
    "max_total_tokens",
)


def _merge(got: list[SchedulerStats]) -> SchedulerStats:
    """Several collectors' entries of one rank: per field, the freshest value."""
    newest = sorted(got, key=lambda s: s.updated, reverse=True)
    top = newest[0]
    vals = {
        f: next((getattr(s, f) for s in newest if getattr(s, f) is not None), None)
        for f in _STAT_FIELDS
    }
    source = "+".join(sorted({n for s in got for n in s.source.split("+") if n}))
    return SchedulerStats(top.worker_id, top.dp_rank, source, **vals, updated=top.updated)

