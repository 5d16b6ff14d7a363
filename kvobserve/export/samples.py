"""Which samples a FleetView serves, written into a Sink: the reference for both renderers.

Samples are written collector by collector (live collectors first, then by id), so a label clash
keeps the first live copy, and so that the cached renderer (export/chunks.py, export/scrape.py)
can keep one collector's samples until its next snapshot and still write the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvobserve import __version__
from kvobserve.analysis.conditions import SOURCE_DOWN, WORKER_TROUBLE
from kvobserve.analysis.fleet import CollectorView, FleetView, StreamView
from kvobserve.export import binds, cache
from kvobserve.export.exposition import Sink
from kvobserve.export.rollup import COUNTER_LABEL, LIFETIME, WorkerSums
from kvobserve.wire.snapshot import SchedulerStats, UnexpectedStream

EVENT_TYPES = ("stored", "removed", "cleared")
SCHEDULER_FIELDS = (
    ("running_requests", "kvobserve_scheduler_running_requests"),
    ("queued_requests", "kvobserve_scheduler_queued_requests"),
    ("token_usage_ratio", "kvobserve_scheduler_token_usage_ratio"),
    ("cache_hit_ratio", "kvobserve_scheduler_cache_hit_ratio"),
    ("max_total_tokens", "kvobserve_scheduler_max_total_tokens"),
)
FOLD = "#fold"  # key prefix of a folded series in a sink's seen-set


@dataclass(frozen=True)
class Detail:
    """Per-stream series beyond the default budget (docs/metrics.md, series budget)."""

    histograms: bool = False  # kvobserve_kv_block_lifetime_seconds per stream and medium
    counters: bool = False  # kvobserve_kv_events_total, _blocks_stored/_removed_total per stream
    shard: str = ""  # sharded aggregators: the `shard` label of per-collector and own series

    def sharded(self, labels: dict[str, str]) -> dict[str, str]:
        """`labels` with this aggregator's `shard` label, when it is one of several."""
        return {**labels, "shard": self.shard} if self.shard else labels


@dataclass
class Group:
    """One collector's part of a FleetView."""

    streams: list[StreamView] = field(default_factory=list)
    unexpected: list[UnexpectedStream] = field(default_factory=list)
    scheduler: list[SchedulerStats] = field(default_factory=list)


def ordered(v: FleetView) -> list[CollectorView]:
    """Live collectors by id, then down ones by id: the order samples are written in."""
    return [c for c in v.collectors if c.up] + [c for c in v.collectors if not c.up]


def groups(v: FleetView) -> dict[str, Group]:
    """Streams, unexpected streams and scheduler stats of the view by collector id."""
    out: dict[str, Group] = {}
    for s in v.streams:
        cid = s.collector.collector_id
        g = out.get(cid)
        if g is None:
            g = out[cid] = Group()
        g.streams.append(s)
    for u, info in v.unexpected:
        out.setdefault(info.collector_id, Group()).unexpected.append(u)
    for sch, info in v.scheduler:
        out.setdefault(info.collector_id, Group()).scheduler.append(sch)
    return out


def fleet(f: Sink, v: FleetView, detail: Detail) -> None:
    """Every catalog sample of the view."""
    by_c = groups(v)
    order = ordered(v)
    sums = WorkerSums()
    for c in order:
        part = WorkerSums()
        collector(f, c, by_c.get(c.info.collector_id) or Group(), part, detail)
        sums.merge(part)
    fleet_level(f, v, order, sums, detail.shard, detail.counters)


def fleet_level(
    f: Sink,
    v: FleetView,
    order: list[CollectorView],
    sums: WorkerSums,
    shard: str = "",
    cache_detail: bool = False,
) -> None:
    """The samples that are not one collector's: build info, ownership, ages, worker sums."""
    sh = Detail(shard=shard).sharded
    f.add("kvobserve_build_info", sh({"version": __version__}), 1)
    for c in order:
        f.add(
            "kvobserve_collector_snapshot_age_seconds",
            sh({"collector": c.info.collector_id}),
            c.age_s,
        )
    for w_id, size in sorted(v.dp_size.items()):
        f.add("kvobserve_worker_dp_size", {"worker_id": w_id}, size)
    for w_id, ids in sorted(v.leaders.items()):
        f.add("kvobserve_worker_leaders", {"worker_id": w_id}, len(ids))
    for (w_id, rank), ids in sorted(v.owners.items()):
        f.add("kvobserve_dp_rank_owners", {"worker_id": w_id, "dp_rank": str(rank)}, len(ids))
    for (w_id, rank), c in sorted(v.last_owner.items()):
        labels = {"worker_id": w_id, "dp_rank": str(rank), "collector": c.info.collector_id,
                  "node_rank": str(c.info.node_rank)}  # fmt: skip
        f.add("kvobserve_dp_rank_last_owner_info", labels, 1)
    for name, labels, value in sums.counter_samples():
        f.add(name, labels, value)
    for labels, h in sums.histogram_samples():
        f.histogram(LIFETIME, labels, h)
    cache.fleet_samples(f, v, sums.cache, cache_detail)


def collector(f: Sink, c: CollectorView, g: Group, sums: WorkerSums, detail: Detail) -> None:
    """One collector's samples; its per-worker sums go to `sums`."""
    i = c.info
    cl = detail.sharded({"collector": i.collector_id})
    f.add(
        "kvobserve_collector_up",
        {"collector": i.collector_id, "node_rank": str(i.node_rank), "hostname": i.hostname, **cl},
        1 if c.up else 0,
    )
    if i.start_time > 0:
        f.add("kvobserve_collector_start_time_seconds", cl, i.start_time)
    for e in c.snapshot.scheduler_errors:  # cumulative: served for a down collector too
        labels = {
            "worker_id": e.worker_id,
            "node_rank": str(i.node_rank),
            "source": e.source,
            "reason": e.reason,
        }
        f.add("kvobserve_scheduler_source_errors_total", labels, e.count)
    for what, n in sorted(c.snapshot.refused.items()):
        f.add("kvobserve_collector_refused_total", {**cl, "what": what}, n)
    k = c.snapshot.counters
    if k is not None:
        f.add("kvobserve_collector_messages_received_total", cl, k.messages_received)
        f.add("kvobserve_collector_ingest_errors_total", cl, k.ingest_errors)
        for reason, n in sorted(k.publish_dropped.items()):
            f.add("kvobserve_collector_publish_dropped_total", {**cl, "reason": reason}, n)
    for s in g.streams:
        stream(f, s, sums, detail)
    node = str(i.node_rank)
    for u in g.unexpected:
        lb = {"worker_id": u.worker_id, "node_rank": node, "dp_rank": str(u.dp_rank)}
        f.add("kvobserve_kv_unexpected_stream", {**lb, "endpoint": u.endpoint}, int(u.active))
    for sch in g.scheduler:
        lb = {"worker_id": sch.worker_id, "node_rank": node, "dp_rank": str(sch.dp_rank)}
        for attr, name in SCHEDULER_FIELDS:
            val = getattr(sch, attr)
            if val is not None:
                f.add(name, lb, val)
    cache.collector_samples(f, c, g.streams, sums, detail.counters, detail.shard)
    configured(f, c)
    binds.collector_samples(f, c)


def configured(f: Sink, c: CollectorView) -> None:
    """The workers and scheduler sources a live collector cannot watch (served only then)."""
    if not c.up:
        return  # a gone collector's gauges leave with it
    cid, node = c.info.collector_id, str(c.info.node_rank)
    for w in c.snapshot.workers:
        if w.state in WORKER_TROUBLE:
            lb = {"worker_id": w.worker_id, "node_rank": node, "collector": cid, "state": w.state}
            f.add("kvobserve_worker_state", lb, 1)
    for s in c.snapshot.sources:
        if s.state in SOURCE_DOWN:
            lb = {"worker_id": s.worker_id, "node_rank": node, "collector": cid}
            f.add(
                "kvobserve_scheduler_source_state", {**lb, "source": s.source, "state": s.state}, 1
            )


def _counter(
    f: Sink, sums: WorkerSums, detail: Detail, name: str, lb: dict[str, str], lv: str, v: float
) -> None:
    """A per-stream counter, or its share of the worker's sum (once per stream series)."""
    label = COUNTER_LABEL[name]
    if detail.counters:
        f.add(name, {**lb, label: lv}, v)
    elif f.fresh((FOLD, name, lb["worker_id"], lb["node_rank"], lb["dp_rank"], lv)):
        sums.counter(name, lb["worker_id"], lv, v)


def stream(f: Sink, s: StreamView, sums: WorkerSums, detail: Detail) -> None:
    """One stream's samples (its gauges only while it is up and its collector too)."""
    st = s.stats
    lb = {
        "worker_id": st.worker_id,
        "node_rank": str(s.collector.node_rank),
        "dp_rank": str(st.dp_rank),
    }
    info = {
        **lb,
        "engine": st.engine,
        "endpoint": st.endpoint,
        "topic": st.topic,
        "collector": s.collector.collector_id,
    }
    f.add("kvobserve_stream_info", info, 1)
    f.add("kvobserve_stream_up", lb, 1 if s.up else 0)
    # Cumulative values stay true after the collector stops: serve them for stale streams too.
    f.add("kvobserve_kv_event_batches_total", lb, st.batches_total)
    events = "kvobserve_kv_events_total"
    for typ in EVENT_TYPES:
        _counter(f, sums, detail, events, lb, typ, st.events.get(typ, 0))
    for typ, n in sorted(st.events.items()):
        if typ not in EVENT_TYPES:  # those were just added: a repeat would be dropped anyway
            _counter(f, sums, detail, events, lb, typ, n)
    f.add("kvobserve_kv_sequence_gaps_total", lb, st.gaps)
    f.add("kvobserve_kv_batches_missed_total", lb, st.missed)
    f.add("kvobserve_kv_batches_recovered_total", lb, st.recovered)
    f.add("kvobserve_kv_batches_lost_total", lb, st.lost)
    for result, n in sorted(st.replay_requests.items()):
        f.add("kvobserve_kv_replay_requests_total", {**lb, "result": result}, n)
    f.add("kvobserve_kv_publisher_restarts_total", lb, st.restarts)
    f.add("kvobserve_kv_duplicate_batches_total", lb, st.duplicate_batches)
    f.add("kvobserve_kv_rank_mismatch_batches_total", lb, st.rank_mismatch_batches)
    if st.interleaved_batches:
        f.add("kvobserve_kv_interleaved_batches_total", lb, st.interleaved_batches)
    unchanged = "kvobserve_kv_blocks_unchanged_total"
    _counter(f, sums, detail, unchanged, lb, "already_resident", st.already_resident)
    _counter(f, sums, detail, unchanged, lb, "not_resident", st.unknown_removed)
    for reason, n in sorted(st.decode_errors.items()):
        f.add("kvobserve_kv_decode_errors_total", {**lb, "reason": reason}, n)
    for m in st.media:
        med = m.medium
        _counter(f, sums, detail, "kvobserve_kv_blocks_stored_total", lb, med, m.stored_total)
        _counter(f, sums, detail, "kvobserve_kv_blocks_removed_total", lb, med, m.removed_total)
        if m.lifetime is None:
            continue
        if detail.histograms:
            f.histogram(LIFETIME, {**lb, "medium": med}, m.lifetime)
        elif f.fresh((FOLD, LIFETIME, st.worker_id, lb["node_rank"], lb["dp_rank"], med)):
            sums.histogram(st.worker_id, med, m.lifetime)
    if st.last_batch_ts > 0:  # health: when it last delivered, down or not
        f.add("kvobserve_kv_last_batch_timestamp_seconds", lb, st.last_batch_ts)
    if not s.up:  # the staleness rule: a down stream's gauges would be its last values
        return
    for m in st.media:
        ml = {**lb, "medium": m.medium}
        f.add("kvobserve_kv_blocks", ml, m.blocks)
        f.add("kvobserve_kv_tokens", ml, m.tokens)
    if s.capacity_tokens:
        f.add("kvobserve_kv_capacity_tokens", lb, s.capacity_tokens)
    usage = s.usage_ratio
    if usage is not None:
        f.add("kvobserve_kv_cache_usage_ratio", lb, usage)
    f.add("kvobserve_kv_duplicate_stream", lb, 1 if st.duplicate_stream else 0)
    f.add("kvobserve_kv_state_complete", lb, 1 if st.state_complete else 0)
    if st.lag_seconds is not None:
        f.add("kvobserve_kv_event_lag_seconds", lb, st.lag_seconds)
