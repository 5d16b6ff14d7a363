"""Both /metrics writers over generated fleets: the same bytes, plain, OpenMetrics and gzip, and
what prometheus_client's own parsers read back is what the reference collector collected.

The fleets (tests/unit/fleet_strategies.py) hold every scope's variants: binds with and without
a relay, llm-d pods, Dynamo planes, down and empty collectors, split and partial snapshots,
clashing streams, scheduler sources, drift, odd label text and values.
"""

from __future__ import annotations

import gzip
from collections import Counter

from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import generate_latest as om_generate_latest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as om_parse,
)
from prometheus_client.parser import text_string_to_metric_families as parse
from prometheus_client.utils import floatToGoString

from kvobserve.analysis.views import FleetView
from kvobserve.export.catalog import CATALOG
from kvobserve.export.exposition import Listed
from kvobserve.export.prometheus import FleetCollector, aggregator_metrics
from kvobserve.export.scrape import ScrapeCache
from kvobserve.export.series import Detail
from tests.unit.fleet_strategies import SnapshotSet, snapshot_sets

Samples = Counter[tuple[str, tuple[tuple[str, str], ...], str]]


def _collector(view: FleetView, detail: Detail, extra: list[Metric]) -> FleetCollector:
    return FleetCollector(
        lambda: view,
        lambda: extra,
        per_stream_detail=detail.per_stream_detail,
        shard=detail.shard,
    )


def _value(v: float) -> str:
    return floatToGoString(float(v))


def _collected(metrics: list[Metric]) -> Samples:
    """Every sample the reference collector gives (name, labels, value as written)."""
    return Counter(
        (s.name, tuple(sorted(s.labels.items())), _value(s.value))
        for m in metrics
        for s in m.samples
    )


def _parsed(body: bytes, om: bool) -> Samples:
    """Every sample prometheus_client's parser reads off a body (which it must accept)."""
    families = (om_parse if om else parse)(body.decode())
    out: Samples = Counter()
    for fam in families:
        for s in fam.samples:
            if om and s.name.endswith("_created"):
                continue  # OpenMetrics' parser adds none here: no family sets a created time
            out[(s.name, tuple(sorted(s.labels.items())), _value(s.value))] += 1
    return out


def _check(cache: ScrapeCache, view: FleetView, extra: list[Metric], parse: bool) -> None:
    """The cached text, plain and gzip, is the reference's bytes, each series once; with
    `parse`, both formats parse back to what the reference collected."""
    metrics = list(_collector(view, cache.detail, extra).collect())
    collected = _collected(metrics)
    assert all(n == 1 for n in collected.values()), [k for k, n in collected.items() if n > 1]
    for om, encoder in ((False, generate_latest), (True, om_generate_latest)):
        want = encoder(Listed(metrics))
        if parse:
            assert _parsed(want, om) == collected
        assert cache.render(view, extra, encoder, om) == want
        packed = cache.render(view, extra, encoder, om, gzip=True)
        assert gzip.decompress(packed) == want


@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(snapshot_sets(), st.booleans(), st.sampled_from(["", "3"]))
def test_both_writers_serve_the_reference_over_generated_fleets(
    fleet: SnapshotSet, detail: bool, shard: str
) -> None:
    state = fleet.state()
    cache = ScrapeCache(Detail(detail, shard))
    extra = aggregator_metrics(state, {"schema": 1}, shard=shard)
    # a render (parsed back), one from the cache as some collectors go stale, and one as all
    # are gone
    for now in (fleet.now, fleet.now + 3.0, fleet.now + 40.0):
        _check(cache, state.view(now), extra, now == fleet.now)


def _features(fleet: SnapshotSet) -> set[str]:
    """The variants a generated fleet holds."""
    out = set()
    parts: Counter[str] = Counter()
    buckets: dict[str, int] = {}
    for snap, received in fleet.snapshots:
        cid = snap.collector.collector_id
        parts[cid] += 1
        buckets[cid] = len(snap.buckets)
        if fleet.now - received > 3:
            out.add("down collector")
        if not snap.workers:
            out.add("empty snapshot")
        streams = [(s.worker_id, s.dp_rank) for s in snap.streams]
        if len(set(streams)) < len(streams):
            out.add("repeated stream")
        for b in snap.binds:
            out.add("bind without relay" if b.relay is None else "bind with relay")
        if any("/" in s.worker_id for s in snap.streams):
            out.add("pods or dynamo streams")
        if snap.dynamo_planes:
            out.add("dynamo plane")
        if snap.unexpected:
            out.add("unexpected stream")
        if snap.scheduler and snap.sources:
            out.add("scheduler sources")
        if snap.drift and snap.drift_sources:
            out.add("drift")
    if any(n > 1 for n in buckets.values()):
        out.add("split snapshot")
    if any(parts[c] < n for c, n in buckets.items()):
        out.add("partial snapshot")
    return out


FEATURES = {
    "down collector", "empty snapshot", "split snapshot", "partial snapshot",
    "repeated stream", "bind without relay",
    "bind with relay", "pods or dynamo streams", "dynamo plane", "unexpected stream",
    "scheduler sources", "drift",
}  # fmt: skip


def test_the_generated_fleets_hold_every_variant_and_serve_every_family() -> None:
    """The property above is not vacuous: within a few hundred fleets, every variant occurs and
    every catalog family is served (with the per-stream detail on)."""
    want = {m.family for m in CATALOG if m.source is not None}
    seen: set[str] = set()
    served: set[str] = set()

    def enough(fleet: SnapshotSet) -> bool:
        seen.update(_features(fleet))
        state = fleet.state()
        fc = _collector(state.view(fleet.now), Detail(per_stream_detail=True), [])
        served.update(m.name for m in fc.collect() if m.samples)
        return seen >= FEATURES and served >= want

    once = settings(
        max_examples=300, phases=[Phase.generate], derandomize=True, database=None, deadline=None
    )
    try:
        find(snapshot_sets(), enough, settings=once)
    except Exception:
        assert FEATURES - seen == set()
        assert want - served == set()
        raise
