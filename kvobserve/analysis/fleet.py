"""Fleet state across collectors: latest snapshot each, staleness, DP-rank ownership, conditions.

Pure: the caller passes `now` (wall-clock seconds, the same clock as `Snapshot.time`).
A collector silent for `stale_intervals` of its own interval is down: it owns nothing, it is
no scheduler leader, and its streams are served as down (stale), never as live.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvobserve.wire.snapshot import (
    CollectorInfo,
    SchedulerStats,
    Snapshot,
    StreamStats,
    UnexpectedStream,
    merge_parts,
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


@dataclass(frozen=True, slots=True)
class CollectorView:
    """One collector as the fleet sees it."""

    info: CollectorInfo
    up: bool
    age_s: float  # seconds since its last snapshot arrived
    snapshot: Snapshot


@dataclass(frozen=True, slots=True)
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
    _conditions: list[Condition] | None = field(default=None, repr=False, compare=False)

    @property
    def conditions(self) -> list[Condition]:
        """The active conditions, worked out on first use (/metrics never needs them)."""
        if self._conditions is None:
            problems = [
                (s.stats, s.collector, s.live) for s in self.streams if _problem(s.live, s.stats)
            ]
            self._conditions = list(_conditions(self, problems))
        return self._conditions


@dataclass(slots=True)
class _Entry:
    snapshot: Snapshot
    received: float


@dataclass(slots=True)
class _Collector:
    """One collector's parts (one per shard bucket; one WHOLE part from older collectors)."""

    parts: dict[int, _Entry] = field(default_factory=dict)
    merged: _Entry | None = None  # the parts as one snapshot; None: to be merged again


def _problem(up: bool, st: StreamStats) -> bool:
    """Whether a stream has a condition (down, duplicate or incomplete)."""
    return not (up and st.up and st.state_complete and not st.duplicate_stream)


class FleetState:
    """The latest snapshot per collector and the fleet view derived from them."""

    def __init__(self, stale_intervals: float = 3.0, forget_after_s: float = 3600.0) -> None:
        self.stale_intervals = stale_intervals
        self.forget_after_s = forget_after_s
        self._collectors: dict[str, _Collector] = {}
        self._order: list[str] = []  # collector ids, sorted; rebuilt when the set changes
        self.snapshots_applied = 0
        self.snapshots_ignored = 0  # older than the one we have (reordered or replayed)

    def update(self, snap: Snapshot, now: float) -> bool:
        """Keep `snap` if it is newer than what we hold for its collector (and its bucket)."""
        cid = snap.collector.collector_id
        c = self._collectors.get(cid)
        if c is None:
            c = self._collectors[cid] = _Collector()
            self._order = []
        start = snap.collector.start_time
        for bucket, e in c.parts.items():
            o = e.snapshot
            older = start < o.collector.start_time
            if older or (
                bucket == snap.bucket and start == o.collector.start_time and snap.seq <= o.seq
            ):
                self.snapshots_ignored += 1
                return False
        if c.parts and start > next(iter(c.parts.values())).snapshot.collector.start_time:
            c.parts.clear()  # a new process: its parts replace every part of the old one
        c.parts[snap.bucket] = _Entry(snap, now)
        c.merged = None
        self.snapshots_applied += 1
        return True

    def snapshot(self, collector_id: str) -> Snapshot | None:
        """The collector's snapshot as served (its parts merged); None if unknown."""
        c = self._collectors.get(collector_id)
        return None if c is None else (c.merged or _merge(c)).snapshot

    def collector_ids(self) -> list[str]:
        """Ids of every collector we hold a snapshot for."""
        return sorted(self._collectors)

    def _is_up(self, e: _Entry, now: float) -> bool:
        return now - e.received <= self.stale_intervals * max(e.snapshot.interval_s, 0.001)

    def _entries(self, now: float) -> list[_Entry]:
        """Each collector's snapshot (its parts merged), by collector id; forgets the silent."""
        out = []
        forget = []
        if not self._order:
            self._order = sorted(self._collectors)
        for cid in self._order:
            c = self._collectors[cid]
            e = c.merged or _merge(c)
            if now - e.received > self.forget_after_s:
                forget.append(cid)
            else:
                out.append(e)
        for cid in forget:
            del self._collectors[cid]
            self._order = []
        return out

    def _membership(self, v: FleetView, entries: list[_Entry], now: float) -> list[bool]:
        """Collectors, dp sizes, owners, leaders, scheduler stats and unexpected streams of the
        view; returns whether each entry is up."""
        ups = []
        for e in entries:
            snap, up = e.snapshot, self._is_up(e, now)
            ups.append(up)
            info = snap.collector
            cid = info.collector_id
            v.collectors.append(CollectorView(info, up, max(0.0, now - e.received), snap))
            for w in snap.workers:
                w_id = w.worker_id
                v.dp_size[w_id] = max(v.dp_size.get(w_id, 0), w.dp_size)
                leaders = v.leaders.setdefault(w_id, [])
                if not up:
                    continue
                for r in w.ranks_owned:
                    ids = v.owners.get((w_id, r))
                    if ids is None:
                        v.owners[(w_id, r)] = [cid]
                    else:
                        ids.append(cid)
                if w.leader:
                    leaders.append(cid)
            if up:
                v.scheduler.extend([(s, info) for s in snap.scheduler])
                v.unexpected.extend([(u, info) for u in snap.unexpected])
        for w_id, size in v.dp_size.items():
            for r in range(size):
                if (w_id, r) not in v.owners:
                    v.owners[(w_id, r)] = []
        return ups

    def view(self, now: float) -> FleetView:
        """The fleet as of `now` (its conditions are worked out when first asked for)."""
        v = FleetView()
        entries = self._entries(now)
        ups = self._membership(v, entries, now)
        capacity: dict[tuple[str, int], float] = {}
        for s, _ in v.scheduler:
            if s.max_total_tokens:
                capacity[(s.worker_id, s.dp_rank)] = s.max_total_tokens
        streams = v.streams
        for e, up in zip(entries, ups, strict=True):
            snap = e.snapshot
            info = snap.collector
            configured = {w.worker_id: w.capacity_tokens for w in snap.workers}
            for st in snap.streams:
                cap: float | None = configured.get(st.worker_id) or None
                if cap is None:
                    cap = capacity.get((st.worker_id, st.dp_rank))
                gpu = 0
                for m in st.media:
                    if m.medium in GPU_MEDIA:
                        gpu += m.tokens
                streams.append(StreamView(st, info, up, cap, gpu))
        streams.sort(key=lambda s: (s.stats.worker_id, s.stats.dp_rank, s.collector.collector_id))
        return v

    def conditions(self, now: float) -> list[Condition]:
        """view(now).conditions, without building the streams' views (the per-second check)."""
        v = FleetView()
        entries = self._entries(now)
        ups = self._membership(v, entries, now)
        found: list[tuple[tuple[str, int, str], int, tuple[StreamStats, CollectorInfo, bool]]] = []
        for e, up in zip(entries, ups, strict=True):
            info = e.snapshot.collector
            for st in e.snapshot.streams:
                if _problem(up, st):
                    key = (st.worker_id, st.dp_rank, info.collector_id)
                    found.append((key, len(found), (st, info, up)))
        found.sort(key=lambda f: f[:2])
        return list(_conditions(v, [p for _, _, p in found]))


def _merge(c: _Collector) -> _Entry:
    """The collector's parts as one entry: the newest part's buckets, received when the
    oldest of them was (a part that stops arriving makes the collector stale)."""
    newest = max(c.parts.values(), key=lambda e: e.snapshot.seq).snapshot
    wanted = set(newest.buckets) | {newest.bucket}
    for bucket in [b for b in c.parts if b not in wanted]:
        del c.parts[bucket]  # a bucket the collector no longer sends
    if len(c.parts) == 1:
        (c.merged,) = c.parts.values()
    else:
        parts = [c.parts[b] for b in sorted(c.parts)]
        snap = merge_parts([e.snapshot for e in parts])
        c.merged = _Entry(snap, min(e.received for e in parts))
    return c.merged


def _labels(**kw: object) -> tuple[tuple[str, str], ...]:
    return tuple((k, str(val)) for k, val in kw.items())


def _conditions(
    v: FleetView, problems: list[tuple[StreamStats, CollectorInfo, bool]]
) -> Iterable[Condition]:
    """The view's conditions; `problems` are its streams that have one, in the view's order."""
    for c in v.collectors:
        if not c.up:
            yield Condition(
                "collector_down",
                "critical",
                _labels(collector=c.info.collector_id, node_rank=c.info.node_rank),
                f"collector {c.info.collector_id} silent for {c.age_s:.0f} s",
            )
    for (w, r), ids in sorted(v.owners.items()):
        if len(ids) == 1:
            continue
        if not ids:
            yield Condition(
                "dp_rank_uncovered",
                "critical",
                _labels(worker_id=w, dp_rank=r),
                f"{w} rank {r} is watched by no live collector",
            )
        else:
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
    for st, info, live in problems:
        where = _labels(worker_id=st.worker_id, node_rank=info.node_rank, dp_rank=st.dp_rank)
        if not (live and st.up):
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
