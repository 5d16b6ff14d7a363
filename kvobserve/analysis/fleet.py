"""Fleet state across collectors: latest snapshot each, staleness, DP-rank ownership, conditions.

Pure: the caller passes `now` (wall-clock seconds, the same clock as `Snapshot.time`).
A collector silent for `stale_intervals` of its own interval is down: it owns nothing, it is
no scheduler leader, and its streams are served as down (stale), never as live.

The staleness rule (docs/metrics.md): a value is in the view only while its source is live. A
stream that is not up (or whose collector is down) keeps its counters and health, but its
gauges are not served (StreamView.up); a rank's scheduler values are left out of the view when
its stream is not up or when they are older than `stale_intervals` periods of their source
(SOURCE_PERIOD_S), so neither /metrics, the API nor a condition shows a dead rank as busy.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import compress
from operator import attrgetter

from kvobserve.analysis.capacity_fleet import CurveMerge
from kvobserve.analysis.conditions import Condition, active, may_have_condition
from kvobserve.analysis.miss_fleet import MissMerge
from kvobserve.analysis.placement import merge_placement
from kvobserve.analysis.tiers import TOP_MEDIA
from kvobserve.analysis.views import CollectorView, FleetView, Key, StreamView
from kvobserve.wire.parts import merge_parts
from kvobserve.wire.snapshot import (
    CollectorInfo,
    SchedulerStats,
    Snapshot,
    WorkerInfo,
    WorkerPlacement,
)

# The longest a healthy scheduler source of each kind stays silent (seconds): SGLang's load PUB
# and FPM PUB send a heartbeat every 1 s, the /metrics scrape runs every interval and may take
# its 2 s timeout, Dynamo's kv_metrics (ActiveLoad) repeats every 10 s. A rank's values are
# stale past `stale_intervals` x the longer of this and its collector's interval, by the
# collector's own clock (`SchedulerStats.updated` against `Snapshot.time`; an `updated` of 0, from
# an older collector, is not judged).
SOURCE_PERIOD_S = {"load": 1.0, "fpm": 1.0, "metrics": 2.0, "kv_metrics": 10.0}
_PERIODS: dict[str, float] = {}  # `+`-joined source names -> _period (a handful of values)


def _period(source: str) -> float:
    """The longest period among the `+`-joined sources (0 for unknown ones)."""
    got = _PERIODS.get(source)
    if got is None:
        got = _PERIODS[source] = max(
            (SOURCE_PERIOD_S.get(n, 0.0) for n in source.split("+")), default=0.0
        )
    return got


_SERIALS = itertools.count(1)  # CollectorView.serial
_SOURCE, _UPDATED = attrgetter("source"), attrgetter("updated")
_RANK, _CAPACITY = attrgetter("worker_id", "dp_rank"), attrgetter("max_total_tokens")


@dataclass(slots=True)
class _Entry:
    snapshot: Snapshot
    received: float
    # its scheduler entries split into (fresh, stale), worked out once per snapshot
    sched: tuple[list[SchedulerStats], list[SchedulerStats]] | None = None
    serial: int = field(default_factory=_SERIALS.__next__)

    def scheduler(
        self, stale_intervals: float
    ) -> tuple[list[SchedulerStats], list[SchedulerStats]]:
        """(the entries fresh enough to serve, the stale ones) of its snapshot: updated within
        `stale_intervals` x the longer of its interval and the source's period (SOURCE_PERIOD_S)
        by the collector's own clock; `updated` 0 (an older collector) is not judged."""
        if self.sched is None:
            snap = self.snapshot
            t, every = snap.time, snap.interval_s
            got = snap.scheduler
            names = set(map(_SOURCE, got))
            if len(names) == 1:  # the usual case: one source, all of it fresh
                bound = t - stale_intervals * max(every, _period(names.pop()))
                if min(filter(None, map(_UPDATED, got)), default=bound) >= bound:
                    self.sched = (got, [])
                    return self.sched
            since: dict[str, float] = {}  # source -> the oldest `updated` still fresh
            stale = []
            for s in got:
                u = s.updated
                if not u:
                    continue
                oldest = since.get(s.source)
                if oldest is None:
                    oldest = since[s.source] = t - stale_intervals * max(every, _period(s.source))
                if u < oldest:
                    stale.append(s)
            fresh = got
            if stale:
                ids = {id(s) for s in stale}
                fresh = [s for s in got if id(s) not in ids]
            self.sched = (fresh, stale)
        return self.sched


@dataclass(slots=True)
class _Ownership:
    """What the collectors' workers said at a view (each collector's id, whether it was up and
    its workers), and the dp sizes, live owners and leaders that follows: kept while they say
    the same (read-only, shared by the views); since when each rank without a live owner has
    had none (the time of the first view that saw it so)."""

    said: list[tuple[str, bool, list[WorkerInfo]]]
    dp_size: dict[str, int]
    owners: dict[tuple[str, int], list[str]]
    leaders: dict[str, list[str]]
    uncovered: dict[tuple[str, int], float]


@dataclass(slots=True)
class _Join:
    """A scheduler join where each rank was read once: the ranks in order, who read how many,
    the collector each rank is served under (its owner, else its reader), and its sources."""

    own: _Ownership
    keys: list[tuple[str, int]]
    readers: list[tuple[str, int]]
    under: list[str]
    names: list[str]
    sources: dict[tuple[str, int], str]


@dataclass(slots=True)
class _Collector:
    """One collector's parts (one per shard bucket; one WHOLE part from older collectors)."""

    parts: dict[int, _Entry] = field(default_factory=dict)
    merged: _Entry | None = None  # the parts as one snapshot; None: to be merged again


class FleetState:
    """The latest snapshot per collector and the fleet view derived from them."""

    def __init__(
        self,
        stale_intervals: float = 3.0,
        forget_after_s: float = 3600.0,
        unvouched_warn_s: float = 600.0,
    ) -> None:
        self.stale_intervals = stale_intervals
        self.unvouched_warn_s = unvouched_warn_s
        self.forget_after_s = forget_after_s
        self._collectors: dict[str, _Collector] = {}
        self._order: list[str] = []  # collector ids, sorted; rebuilt when the set changes
        self._own: _Ownership | None = None  # the last view's ownership, and its join
        self._join: _Join | None = None
        self.snapshots_applied = 0
        self.snapshots_ignored = 0  # older than the one we have (reordered or replayed)
        self.misses = MissMerge()  # where the misses come from: every pool's sampled split
        self.capacity = CurveMerge()  # what more memory would buy: every pool's curves

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
        self.misses.add(snap, now)
        self.capacity.add(snap, self.misses)
        return True

    def snapshot(self, collector_id: str) -> Snapshot | None:
        """The collector's snapshot as served (its parts merged); None if unknown."""
        c = self._collectors.get(collector_id)
        return None if c is None else (c.merged or _merge(c)).snapshot

    def collector_ids(self) -> list[str]:
        """Ids of every collector we hold a snapshot for."""
        return sorted(self._collectors)

    def size(self) -> int:
        """How many collectors we hold a snapshot for."""
        return len(self._collectors)

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
            self.misses.forget(cid)
            self.capacity.forget(cid)
        return out

    def _membership(
        self, v: FleetView, entries: list[_Entry], now: float
    ) -> tuple[list[bool], dict[tuple[str, int], str], dict[tuple[str, int], float]]:
        """Collectors, dp sizes, owners, leaders, the joined scheduler stats and unexpected
        streams of the view; returns whether each entry is up, the scheduler sources and the
        capacity reported per (worker_id, dp_rank)."""
        ups = [self._is_up(e, now) for e in entries]
        own = self._ownership(entries, ups, now)
        v.dp_size, v.owners, v.leaders = dict(own.dp_size), dict(own.owners), dict(own.leaders)
        v.uncovered_since = own.uncovered
        reported: list[tuple[list[SchedulerStats], CollectorInfo]] = []  # fresh, by collector
        lost: dict[tuple[str, int], CollectorView] = {}  # the ranks of down collectors
        quiet: dict[tuple[str, int], tuple[str, float | None]] = {}  # stale: source, capacity
        for e, up in zip(entries, ups, strict=True):
            snap = e.snapshot
            info = snap.collector
            cv = CollectorView(info, up, max(0.0, now - e.received), snap, e.serial)
            v.collectors.append(cv)
            if not up:
                for w in snap.workers:
                    for r in w.ranks_owned:  # by id: the latest snapshot wins, ties the last id
                        had = lost.get((w.worker_id, r))
                        if had is None or snap.time >= had.snapshot.time:
                            lost[(w.worker_id, r)] = cv
                continue
            fresh, stale = e.scheduler(self.stale_intervals)
            if fresh:
                reported.append((fresh, info))
            for s in stale:  # not served; still who reports the rank, and its capacity
                quiet[(s.worker_id, s.dp_rank)] = (s.source, s.max_total_tokens)
            v.unexpected.extend([(u, info) for u in snap.unexpected])
            v.workers.extend([(w, info) for w in snap.workers])
            v.sources.extend([(src, info) for src in snap.sources])
        for key, cv in lost.items():
            if key in v.owners and not v.owners[key]:  # no live collector owns it
                v.last_owner[key] = cv
        capacity: dict[tuple[str, int], float] = {}
        sources = self._join_scheduler(v, own, reported, capacity)
        for key, (source, cap) in quiet.items():
            sources.setdefault(key, source)
            if cap:  # a constant of the engine process: still the capacity
                capacity.setdefault(key, cap)
        return ups, sources, capacity

    def _ownership(self, entries: list[_Entry], ups: list[bool], now: float) -> _Ownership:
        """Dp sizes (every collector's word), live owners of each rank (none: uncovered) and
        scheduler leaders; the last view's while every collector says the same. A rank still
        uncovered keeps when it became so; one uncovered anew, `now`."""
        said = [
            (e.snapshot.collector.collector_id, up, e.snapshot.workers)
            for e, up in zip(entries, ups, strict=True)
        ]
        own = self._own
        if own is not None and own.said == said:
            return own
        dp_size: dict[str, int] = {}
        owners: dict[tuple[str, int], list[str]] = {}
        leaders: dict[str, list[str]] = {}
        for cid, up, workers in said:
            for w in workers:
                w_id = w.worker_id
                dp_size[w_id] = max(dp_size.get(w_id, 0), w.dp_size)
                led = leaders.setdefault(w_id, [])
                if not up:
                    continue
                for r in w.ranks_owned:
                    ids = owners.get((w_id, r))
                    if ids is None:
                        owners[(w_id, r)] = [cid]
                    else:
                        ids.append(cid)
                if w.leader:
                    led.append(cid)
        for w_id, size in dp_size.items():
            for r in range(size):
                if (w_id, r) not in owners:
                    owners[(w_id, r)] = []
        before = own.uncovered if own is not None else {}
        uncovered = {k: before.get(k, now) for k, ids in owners.items() if not ids}
        self._own = own = _Ownership(said, dp_size, owners, leaders, uncovered)
        return own

    def view(self, now: float) -> FleetView:
        """The fleet as of `now` (its conditions: analysis/conditions.py `active`)."""
        v = FleetView(now=now, unvouched_warn_s=self.unvouched_warn_s)
        entries = self._entries(now)
        ups, sources, capacity = self._membership(v, entries, now)
        built: list[StreamView] = []
        place: list[tuple[str, int, str]] = []  # each one's place in the view
        placements: dict[str, list[WorkerPlacement]] = {}
        down: set[tuple[str, int]] = set()  # ranks with a stream that is not up
        for e, up in zip(entries, ups, strict=True):
            snap = e.snapshot
            info = snap.collector
            cid = info.collector_id
            configured = {w.worker_id: w.capacity_tokens for w in snap.workers}
            for st in snap.streams:
                w_id, rank = st.worker_id, st.dp_rank
                key = (w_id, rank)
                if not (up and st.up):
                    down.add(key)
                cap: float | None = configured.get(w_id) or None
                if cap is None:
                    cap = capacity.get(key)
                gpu = 0
                for m in st.media:
                    if m.medium in TOP_MEDIA:
                        gpu += m.tokens
                built.append(StreamView(st, info, up, cap, gpu, sources.get(key), snap.time))
                place.append((w_id, rank, cid))
            if up:
                for p in snap.placement:
                    placements.setdefault(p.worker_id, []).append(p)
        # by worker, rank and collector (sorting the places: no key function per stream)
        v.streams = list(map(built.__getitem__, sorted(range(len(built)), key=place.__getitem__)))
        v.placement = {w: merge_placement(ps) for w, ps in sorted(placements.items())}
        _drop_dead_ranks(v, entries, ups, down)
        self._misses(v, entries, ups)
        v.capacity = self.capacity.views(v, self.misses)
        return v

    def _misses(self, v: FleetView, entries: list[_Entry], ups: list[bool]) -> None:
        """The pools' miss splits as of the view; a collector down is waited for no longer."""
        gone = {e.snapshot.collector.collector_id for e, up in zip(entries, ups, strict=True)
                if not up}  # fmt: skip
        self.misses.collectors_down(gone)
        v.misses = self.misses.views(v)

    def membership(self, now: float) -> FleetView:
        """The view's membership only (collectors, dp sizes, rank owners, leaders, the last
        owners of uncovered ranks), without streams: a tenth of a whole view's cost (what
        /api/v1/overlap reads per request)."""
        v = FleetView(now=now)
        self._membership(v, self._entries(now), now)
        return v

    def conditions(self, now: float, began: dict[Key, float] | None = None) -> list[Condition]:
        """The conditions of view(now) (analysis/conditions.py `active`), building views only
        of the streams some condition's pre-check lets through (the per-second check); `began`
        as FleetView.began."""
        v = FleetView(now=now, began=began or {})
        entries = self._entries(now)
        ups, _, _ = self._membership(v, entries, now)
        down: set[tuple[str, int]] = set()
        for e, up in zip(entries, ups, strict=True):
            snap = e.snapshot
            for st in snap.streams:
                if not (up and st.up):
                    down.add((st.worker_id, st.dp_rank))
                if may_have_condition(st, up, now):
                    v.streams.append(StreamView(st, snap.collector, up, None, 0, None, snap.time))
        v.streams.sort(key=lambda s: (s.stats.worker_id, s.stats.dp_rank, s.collector.collector_id))
        _drop_dead_ranks(v, entries, ups, down)
        if self.misses.pools:  # its trust reads the pools' streams: they all pass the filter
            self._misses(v, entries, ups)
        return active(v)

    def _join_scheduler(
        self,
        v: FleetView,
        own: _Ownership,
        reported: list[tuple[list[SchedulerStats], CollectorInfo]],
        capacity: dict[tuple[str, int], float],
    ) -> dict[tuple[str, int], str]:
        """One scheduler entry per (worker_id, dp_rank), whoever read it, under the rank's owner.

        The leader reads worker-wide sources, every node its own ranks' channels: the same rank
        can come from two collectors (`reported`: each live collector's fresh entries). Per
        field the freshest value wins; the entry is served with the node_rank of the collector
        that owns the rank (the reader's when none does). Returns (worker_id, dp_rank) -> the
        sources that reported it.
        """
        infos = {c.info.collector_id: c.info for c in v.collectors if c.up}
        keys: list[tuple[str, int]] = []
        stats: list[SchedulerStats] = []
        for got, _ in reported:
            keys.extend(map(_RANK, got))
            stats.extend(got)
        readers = [(info.collector_id, len(got)) for got, info in reported]
        names = list(map(_SOURCE, stats))
        j = self._join
        if (
            j is None
            or j.own is not own
            or j.keys != keys
            or j.readers != readers
            or j.names != names
        ):
            j = self._joined(own, keys, stats, readers, names, reported)
        if j is not None:  # the usual case: each rank read once, as at the last view
            v.scheduler = list(zip(stats, map(infos.__getitem__, j.under), strict=True))
            caps = list(map(_CAPACITY, stats))
            capacity.update(compress(zip(keys, caps, strict=True), caps))
            return j.sources
        # a rank read by two collectors: joined per field
        by: dict[tuple[str, int], list[tuple[SchedulerStats, CollectorInfo]]] = {}
        for got, info in reported:
            for s in got:
                by.setdefault((s.worker_id, s.dp_rank), []).append((s, info))
        out = {}
        for key, copies in by.items():
            read = [s for s, _ in copies]
            one = read[0] if len(read) == 1 else _merge_stats(read)
            ids = own.owners.get(key)  # live collectors only
            v.scheduler.append((one, infos[ids[0]] if ids else copies[0][1]))
            if one.max_total_tokens:
                capacity[key] = one.max_total_tokens
            out[key] = _sources(read)
        return out

    def _joined(
        self,
        own: _Ownership,
        keys: list[tuple[str, int]],
        stats: list[SchedulerStats],
        readers: list[tuple[str, int]],
        names: list[str],
        reported: list[tuple[list[SchedulerStats], CollectorInfo]],
    ) -> _Join | None:
        """The join where each rank was read once (kept for the next views); None otherwise."""
        self._join = None
        if len(set(keys)) < len(keys):
            return None
        read_by = [info.collector_id for got, info in reported for _ in got]
        under = []
        for key, reader in zip(keys, read_by, strict=True):
            ids = own.owners.get(key)  # live collectors only
            under.append(ids[0] if ids else reader)
        fixed = [_sources([s]) if "+" in s.source else s.source for s in stats]
        self._join = _Join(own, keys, readers, under, names, dict(zip(keys, fixed, strict=True)))
        return self._join


def _drop_dead_ranks(
    v: FleetView, entries: list[_Entry], ups: list[bool], down: set[tuple[str, int]]
) -> None:
    """Leave out the scheduler entries of ranks none of whose streams is up (a dead engine's
    scheduler values are its last ones). A rank with no stream in the view keeps its entry."""
    if not down:
        return
    workers = {w for w, _ in down}
    for e, up in zip(entries, ups, strict=True):
        if not up:
            continue
        for st in e.snapshot.streams:
            if st.up and st.worker_id in workers:
                down.discard((st.worker_id, st.dp_rank))  # another copy of the rank is up
    if down:
        v.scheduler = [(s, i) for s, i in v.scheduler if (s.worker_id, s.dp_rank) not in down]


_STAT_FIELDS = (
    "running_requests",
    "queued_requests",
    "token_usage_ratio",
    "cache_hit_ratio",
    "max_total_tokens",
)


def _merge_stats(got: list[SchedulerStats]) -> SchedulerStats:
    """Several collectors' entries of one rank: per field, the freshest value."""
    newest = sorted(got, key=lambda s: s.updated, reverse=True)
    top = newest[0]
    vals = {
        f: next((getattr(s, f) for s in newest if getattr(s, f) is not None), None)
        for f in _STAT_FIELDS
    }
    return SchedulerStats(top.worker_id, top.dp_rank, _sources(got), **vals, updated=top.updated)


def _sources(got: Iterable[SchedulerStats]) -> str:
    """The sources of entries of one rank, each once, sorted and `+`-joined."""
    return "+".join(sorted({n for s in got for n in s.source.split("+") if n}))


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
