"""A prometheus_client Collector that renders the FleetView at scrape time; nothing per event."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvobserve import __version__
from kvobserve.analysis.fleet import FleetState, FleetView, StreamView
from kvobserve.export.catalog import BY_NAME, render_docs
from kvobserve.export.exposition import Listed, MetricFamilies, Sink, TextFamilies
from kvobserve.transport import Transport, TransportStatus
from kvobserve.wire.snapshot import Family

if TYPE_CHECKING:
    from kvobserve.wire.snapshot import StreamStats

ViewProvider = Callable[[], FleetView]
ExtraProvider = Callable[[], Iterable[Metric]]

_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "gauge": ("",),
    "unknown": ("",),
}


def render_exposition(
    view: FleetView,
    extra: Sequence[Metric],
    encoder: Callable[[Any], bytes],
    openmetrics: bool = False,
) -> bytes:
    """The whole /metrics body: catalog families rendered here, extras and passthrough by
    `encoder` (prometheus_client's, from choose_encoder: it also writes OpenMetrics' # EOF).

    Same bytes as `encoder` over FleetCollector.collect() for the text format 0.0.4 and for
    OpenMetrics with legacy-valid names (every name here is).
    """
    f = TextFamilies()
    f.add("kvobserve_build_info", {"version": __version__}, 1)
    _fleet(f, view)
    head, taken = f.text(openmetrics)
    rest = []
    for m in [*extra, *_passthrough(view)]:
        if m.name not in taken:
            taken.add(m.name)
            rest.append(m)
    return head.encode() + encoder(Listed(rest))


def _stream_labels(s: StreamView) -> dict[str, str]:
    st = s.stats
    return {
        "worker_id": st.worker_id,
        "node_rank": str(s.collector.node_rank),
        "dp_rank": str(st.dp_rank),
    }


_EVENT_TYPES = ("stored", "removed", "cleared")


def _stream(f: Sink, s: StreamView) -> None:
    st: StreamStats = s.stats
    lb = _stream_labels(s)
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
    for typ in _EVENT_TYPES:
        f.add("kvobserve_kv_events_total", {**lb, "type": typ}, st.events.get(typ, 0))
    for typ, n in sorted(st.events.items()):
        if typ not in _EVENT_TYPES:  # those were just added: a repeat would be dropped anyway
            f.add("kvobserve_kv_events_total", {**lb, "type": typ}, n)
    f.add("kvobserve_kv_sequence_gaps_total", lb, st.gaps)
    f.add("kvobserve_kv_batches_missed_total", lb, st.missed)
    f.add("kvobserve_kv_batches_recovered_total", lb, st.recovered)
    f.add("kvobserve_kv_batches_lost_total", lb, st.lost)
    for result, n in sorted(st.replay_requests.items()):
        f.add("kvobserve_kv_replay_requests_total", {**lb, "result": result}, n)
    f.add("kvobserve_kv_publisher_restarts_total", lb, st.restarts)
    f.add("kvobserve_kv_duplicate_batches_total", lb, st.duplicate_batches)
    f.add("kvobserve_kv_rank_mismatch_batches_total", lb, st.rank_mismatch_batches)
    for reason, n in sorted(st.decode_errors.items()):
        f.add("kvobserve_kv_decode_errors_total", {**lb, "reason": reason}, n)
    media = [(m, {**lb, "medium": m.medium}) for m in st.media]  # one label dict per medium
    for m, ml in media:
        f.add("kvobserve_kv_blocks_stored_total", ml, m.stored_total)
        f.add("kvobserve_kv_blocks_removed_total", ml, m.removed_total)
        if m.lifetime is not None:
            f.histogram("kvobserve_kv_block_lifetime_seconds", ml, m.lifetime)
    if not s.live:
        return
    for m, ml in media:
        f.add("kvobserve_kv_blocks", ml, m.blocks)
        f.add("kvobserve_kv_tokens", ml, m.tokens)
    if s.capacity_tokens:
        f.add("kvobserve_kv_capacity_tokens", lb, s.capacity_tokens)
    usage = s.usage_ratio
    if usage is not None:
        f.add("kvobserve_kv_cache_usage_ratio", lb, usage)
    f.add("kvobserve_kv_duplicate_stream", lb, 1 if st.duplicate_stream else 0)
    f.add("kvobserve_kv_state_complete", lb, 1 if st.state_complete else 0)
    if st.last_batch_ts > 0:
        f.add("kvobserve_kv_last_batch_timestamp_seconds", lb, st.last_batch_ts)
    if st.lag_seconds is not None:
        f.add("kvobserve_kv_event_lag_seconds", lb, st.lag_seconds)


_SCHEDULER_FIELDS = (
    ("running_requests", "kvobserve_scheduler_running_requests"),
    ("queued_requests", "kvobserve_scheduler_queued_requests"),
    ("token_usage_ratio", "kvobserve_scheduler_token_usage_ratio"),
    ("cache_hit_ratio", "kvobserve_scheduler_cache_hit_ratio"),
    ("max_total_tokens", "kvobserve_scheduler_max_total_tokens"),
)


def _fleet(f: Sink, v: FleetView) -> None:
    for c in v.collectors:
        i = c.info
        cl = {"collector": i.collector_id}
        f.add(
            "kvobserve_collector_up",
            {"collector": i.collector_id, "node_rank": str(i.node_rank), "hostname": i.hostname},
            1 if c.up else 0,
        )
        f.add("kvobserve_collector_snapshot_age_seconds", cl, c.age_s)
        if i.start_time > 0:
            f.add("kvobserve_collector_start_time_seconds", cl, i.start_time)
        for e in c.snapshot.scheduler_errors:  # cumulative: served for a down collector too
            labels = {"worker_id": e.worker_id, "source": e.source, "reason": e.reason}
            f.add("kvobserve_scheduler_source_errors_total", labels, e.count)
        for what, n in sorted(c.snapshot.refused.items()):
            f.add("kvobserve_collector_refused_total", {**cl, "what": what}, n)
    for w_id, size in sorted(v.dp_size.items()):
        f.add("kvobserve_worker_dp_size", {"worker_id": w_id}, size)
    for w_id, ids in sorted(v.leaders.items()):
        f.add("kvobserve_worker_leaders", {"worker_id": w_id}, len(ids))
    for (w_id, rank), ids in sorted(v.owners.items()):
        f.add("kvobserve_dp_rank_owners", {"worker_id": w_id, "dp_rank": str(rank)}, len(ids))
    for s in sorted(v.streams, key=lambda s: not s.live):  # a live copy wins a label clash
        _stream(f, s)
    for u, info in v.unexpected:
        lb = {
            "worker_id": u.worker_id,
            "node_rank": str(info.node_rank),
            "dp_rank": str(u.dp_rank),
            "endpoint": u.endpoint,
        }
        f.add("kvobserve_kv_unexpected_stream", lb, 1 if u.active else 0)
    for sch, info in v.scheduler:
        lb = {
            "worker_id": sch.worker_id,
            "node_rank": str(info.node_rank),
            "dp_rank": str(sch.dp_rank),
        }
        for attr, name in _SCHEDULER_FIELDS:
            val = getattr(sch, attr)
            if val is not None:
                f.add(name, lb, val)


def _passthrough(v: FleetView) -> Iterator[Metric]:
    """Live collectors' engine families, merged by name; invalid or clashing ones are dropped."""
    merged: dict[str, Metric] = {}
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for c in v.collectors:
        if not c.up:
            continue
        for fam in c.snapshot.passthrough:
            m = _passthrough_family(fam, merged)
            if m is None:
                continue
            for smp in fam.samples:
                sname = _promname(smp.name)
                if not sname.startswith(m.name) or sname[len(m.name) :] not in _SUFFIXES[m.type]:
                    continue
                if not all(_LABEL_RE.match(k) for k in smp.labels):
                    continue
                key = (sname, tuple(sorted(smp.labels.items())))
                if key not in seen:
                    seen.add(key)
                    m.add_sample(sname, dict(smp.labels), smp.value)
    yield from (m for m in merged.values() if m.samples)


def _promname(name: str) -> str:
    # Colons are reserved for recording rules (promtool lint): sglang:num_running_reqs is
    # served as sglang_num_running_reqs.
    return name.replace(":", "_")


def _passthrough_family(fam: Family, merged: dict[str, Metric]) -> Metric | None:
    typ = fam.type if fam.type in ("counter", "gauge", "histogram", "summary") else "unknown"
    name = _promname(fam.name)
    if typ == "counter" and name.endswith("_total"):
        name = name[: -len("_total")]
    if not _NAME_RE.match(name) or name.startswith("kvobserve_"):
        return None  # kvobserve_* is ours: an engine must not shadow the catalog
    m = merged.get(name)
    if m is None:
        m = merged[name] = Metric(name, fam.help or name, typ)
    return m if m.type == typ else None


class FleetCollector(Collector):
    """Builds every catalog family from the current FleetView, plus passthrough and extras."""

    def __init__(self, view_provider: ViewProvider, extra: ExtraProvider | None = None) -> None:
        self._view = view_provider
        self._extra = extra

    def exposition(
        self, encoder: Callable[[Any], bytes], openmetrics: bool = False
    ) -> Callable[[], bytes]:
        """Take the view and the extras now; the returned function renders the body (any thread)."""
        v = self._view()
        extra = list(self._extra()) if self._extra is not None else []
        return partial(render_exposition, v, extra, encoder, openmetrics)

    def collect(self) -> Iterable[Metric]:
        """Metric families of one scrape."""
        f = MetricFamilies()
        f.add("kvobserve_build_info", {"version": __version__}, 1)
        v = self._view()
        _fleet(f, v)
        out = [m for m in f.metrics.values() if m.samples]
        taken = {m.name for m in out}
        # A repeated family name would make the whole scrape invalid: first one wins.
        for m in [*(self._extra() if self._extra is not None else ()), *_passthrough(v)]:
            if m.name not in taken:
                taken.add(m.name)
                out.append(m)
        return out


def catalog_metric(name: str, samples: Iterable[tuple[Mapping[str, str], float]]) -> Metric:
    """A catalog family with the given samples, for `extra` (the name must be in the catalog)."""
    d = BY_NAME[name]
    m = Metric(d.family, d.help, d.type)
    for labels, value in samples:
        m.add_sample(d.name, dict(labels), value)
    return m


def aggregator_metrics(
    state: FleetState,
    decode_errors: Mapping[str, int] | None = None,
    nats: Transport | None = None,
) -> list[Metric]:
    """The aggregator's own counters (snapshots, decode errors, NATS), for `extra`."""
    out = []
    if nats is not None:
        c = nats.counters
        up = 1.0 if nats.status is TransportStatus.CONNECTED else 0.0
        out = [
            catalog_metric("kvobserve_nats_connected", [({}, up)]),
            catalog_metric("kvobserve_nats_snapshots_received_total", [({}, c.received)]),
            catalog_metric("kvobserve_nats_reconnects_total", [({}, c.reconnects)]),
            catalog_metric(
                "kvobserve_nats_dropped_total",
                [({"reason": r}, n) for r, n in sorted(c.dropped.items())],
            ),
        ]
    return [
        *out,
        catalog_metric(
            "kvobserve_aggregator_snapshots_applied_total", [({}, state.snapshots_applied)]
        ),
        catalog_metric(
            "kvobserve_aggregator_snapshots_ignored_total", [({}, state.snapshots_ignored)]
        ),
        catalog_metric(
            "kvobserve_aggregator_snapshot_decode_errors_total",
            [({"reason": r}, n) for r, n in sorted((decode_errors or {}).items())],
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    """`python -m kvobserve.export.prometheus --docs`: print docs/metrics.md."""
    p = argparse.ArgumentParser(prog="python -m kvobserve.export.prometheus")
    p.add_argument("--docs", action="store_true", help="print docs/metrics.md")
    args = p.parse_args(argv)
    if not args.docs:
        p.print_help()
        return 2
    sys.stdout.write(render_docs())
    return 0


if __name__ == "__main__":
    sys.exit(main())
