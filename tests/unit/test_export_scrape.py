"""The cached /metrics renderer: prometheus_client's bytes, plain and gzip, as the fleet changes."""

from __future__ import annotations

import gzip
import time
import zlib
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import generate_latest as om_generate_latest

from benchmarks import scale
from kvobserve.analysis.fleet import FleetState
from kvobserve.analysis.views import FleetView
from kvobserve.export.prometheus import FleetCollector, catalog_metric
from kvobserve.export.scrape import ScrapeCache
from kvobserve.export.series import Detail
from tests.unit.test_export_fleet import NOW, rich_state

EXTRA = [catalog_metric("kvobserve_nats_connected", [({}, 1.0)])]
DETAILS = [
    Detail(),
    Detail(per_stream_detail=True),
    Detail(shard="1"),  # one of several sharded aggregators: per-collector series labelled
]


def reference(view: FleetView, detail: Detail, om: bool, extra: list[Metric] = EXTRA) -> bytes:
    """prometheus_client's encoder over FleetCollector.collect()."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(
        FleetCollector(
            lambda: view,
            lambda: extra,
            per_stream_detail=detail.per_stream_detail,
            shard=detail.shard,
        )
    )
    return (om_generate_latest if om else generate_latest)(reg)


def encoder(om: bool) -> Callable[[Any], bytes]:
    return om_generate_latest if om else generate_latest


def check(cache: ScrapeCache, view: FleetView, om: bool) -> bytes:
    """The cached body equals prometheus_client's, and so does its gzip form."""
    want = reference(view, cache.detail, om)
    assert cache.render(view, EXTRA, encoder(om), om) == want
    packed = cache.render(view, EXTRA, encoder(om), om, gzip=True)
    d = zlib.decompressobj(wbits=31)
    assert d.decompress(packed) == want
    assert d.eof and d.unused_data == b""  # one gzip member, nothing after it
    assert gzip.decompress(packed) == want
    if om:
        assert want.endswith(b"# EOF\n")
    return want


def synthetic(collectors: int, seq: int, now: float) -> FleetState:
    fs = FleetState()
    for c in range(collectors):
        fs.update(scale.synthetic_snapshot(c, 8, seq, now), now)
    return fs


@pytest.mark.parametrize("om", [False, True])
@pytest.mark.parametrize("detail", DETAILS, ids=["default", "detail", "shard"])
def test_cached_bytes_equal_prometheus_client(om: bool, detail: Detail) -> None:
    now = time.time()
    clash = rich_state()
    clash.snapshot("node-1").collector.node_rank = 0  # two collectors claim a stream
    views = [rich_state().view(NOW), synthetic(6, 3, now).view(now), FleetView(), clash.view(NOW)]
    for view in views:
        cache = ScrapeCache(detail)
        check(cache, view, om)
        check(cache, view, om)  # from the cache this time


def _families(body: bytes) -> dict[bytes, list[bytes]]:
    """The sample lines of each family of a body (its # TYPE name)."""
    out: dict[bytes, list[bytes]] = {}
    name = b""
    for line in body.splitlines():
        if line.startswith(b"# TYPE "):
            name = line.split()[2]
        elif not line.startswith(b"#"):
            out.setdefault(name, []).append(line)
    return out


def _changed(a: bytes, b: bytes) -> int:
    """How many families' lines differ between two bodies."""
    fa, fb = _families(a), _families(b)
    return sum(1 for n in {*fa, *fb} if fa.get(n) != fb.get(n))


def test_a_family_whose_values_are_the_same_keeps_its_text() -> None:
    now = time.time()
    fs = synthetic(6, 3, now)
    cache = ScrapeCache()
    body = check(cache, fs.view(now), False)
    steps = [
        (now + 0.5, None),  # nothing new: the wall clock only moves the ages
        (now + 1, 2),  # a leader's snapshot: its scheduler entries serve node-003's ranks
        (now + 1, 3),
        (now + 10, 0),  # only node 0 reports: the others go stale, their gauges leave
    ]
    for t, c in steps:
        if c is not None:
            fs.update(scale.synthetic_snapshot(c, 8, 4, t), t)
        before = cache.written
        new = check(cache, fs.view(t), False)  # plain, then gzip of the same view
        assert 0 < cache.written - before == _changed(body, new)
        body = new


def test_a_collector_going_stale_is_rendered_as_down() -> None:
    now = time.time()
    fs = synthetic(4, 3, now)
    cache = ScrapeCache()
    before = check(cache, fs.view(now), False)
    fs.update(scale.synthetic_snapshot(0, 8, 4, now + 10), now + 10)  # only node 0 reports
    after = check(cache, fs.view(now + 10), False)
    assert after.count(b"kvobserve_stream_up{") == before.count(b"kvobserve_stream_up{")
    assert after.count(b"kvobserve_kv_blocks{") == 8  # the three stale collectors' gauges left
    fs.update(scale.synthetic_snapshot(1, 8, 4, now + 10), now + 10)  # node 1 is back
    back = check(cache, fs.view(now + 10), False)
    assert back.count(b"kvobserve_kv_blocks{") == 16


def test_capacity_joined_from_another_collector_invalidates_the_chunk() -> None:
    # node-1 serves sglang-a rank 1 with the capacity that node-0's scheduler data gives.
    state = rich_state()
    cache = ScrapeCache()
    first = check(cache, state.view(NOW), False)
    assert (
        b'kvobserve_kv_capacity_tokens{dp_rank="1",node_rank="1",worker_id="sglang-a"} 640.0'
        in first
    )
    snap = state.snapshot("node-0")
    sched = [msgspec.structs.replace(s, max_total_tokens=1280) for s in snap.scheduler]
    state.update(msgspec.structs.replace(snap, seq=snap.seq + 1, scheduler=sched), NOW)
    second = check(cache, state.view(NOW), False)
    assert (
        b'kvobserve_kv_capacity_tokens{dp_rank="1",node_rank="1",worker_id="sglang-a"} 1280.0'
        in second
    )


def test_gzip_with_few_or_many_changed_collectors() -> None:
    now = time.time()
    fs = synthetic(8, 3, now)
    cache = ScrapeCache()
    check(cache, fs.view(now), False)  # text cached: the next gzip scrape keeps segments per piece
    check(cache, fs.view(now), True)
    for c in range(8):  # every collector new: one segment per family
        fs.update(scale.synthetic_snapshot(c, 8, 4, now + 1), now + 1)
    check(cache, fs.view(now + 1), True)
    fs.update(scale.synthetic_snapshot(5, 8, 5, now + 2), now + 2)  # one new
    check(cache, fs.view(now + 2), False)


def test_a_forgotten_collector_leaves_the_cache() -> None:
    now = time.time()
    fs = FleetState(forget_after_s=60)
    for c in range(3):
        fs.update(scale.synthetic_snapshot(c, 8, 3, now), now)
    cache = ScrapeCache()
    check(cache, fs.view(now), False)
    fs.update(scale.synthetic_snapshot(0, 8, 4, now + 100), now + 100)
    body = check(cache, fs.view(now + 100), False)
    assert body.count(b"kvobserve_collector_up{") == 1


def test_templates_follow_shape_changes_and_keep_percent_signs() -> None:
    # A stream's lines come from its collector's template: a new medium, replay result, a
    # stream going stale and label values with % (the template's own marker) change it.
    state = rich_state()
    cache = ScrapeCache()
    check(cache, state.view(NOW), False)
    snap = state.snapshot("node-0")
    assert snap is not None
    st = snap.streams[1]
    odd = msgspec.structs.replace(
        st,
        endpoint="tcp://h:1/%s%%d",
        topic="100%",
        replay_requests={"timeout": 2, "ok": 5},  # not in key order
        media=[*st.media, msgspec.structs.replace(st.media[0], medium="CPU%")],
        batches_total=st.batches_total + 1,
    )
    streams = [snap.streams[0], odd, *snap.streams[2:]]
    state.update(msgspec.structs.replace(snap, seq=snap.seq + 1, streams=streams), NOW)
    body = check(cache, state.view(NOW), False)
    assert b'endpoint="tcp://h:1/%s%%d"' in body and b'medium="CPU%"' in body
    check(cache, state.view(NOW + 100), True)  # every collector stale: gauges go
    check(ScrapeCache(), state.view(NOW), False)  # templates built afresh: the same bytes


def test_gzip_of_whole_families_as_every_collector_changes() -> None:
    # Every collector new each time: one deflate segment per family, kept for the families
    # whose lines did not change (the gauges here) and made again for the others.
    now = time.time()
    fs = synthetic(8, 3, now)
    cache = ScrapeCache()
    for seq in (4, 5, 6):
        for c in range(8):
            fs.update(scale.synthetic_snapshot(c, 8, seq, now + seq), now + seq)
        view = fs.view(now + seq)
        packed = cache.render(view, EXTRA, encoder(False), False, gzip=True)
        assert gzip.decompress(packed) == reference(view, Detail(), False)


def test_label_values_with_a_nul_are_written_as_prometheus_client_does() -> None:
    state = rich_state()
    snap = state.snapshot("node-0")
    assert snap is not None
    odd = msgspec.structs.replace(snap.streams[0], endpoint="tcp://h:1/\x00x", topic="\x00")
    state.update(
        msgspec.structs.replace(snap, seq=snap.seq + 1, streams=[odd, *snap.streams[1:]]), NOW
    )
    cache = ScrapeCache()
    body = check(cache, state.view(NOW), False)
    assert b'endpoint="tcp://h:1/\x00x"' in body
    check(cache, state.view(NOW), True)


def test_a_label_clash_as_collectors_change() -> None:
    # Two collectors claim a stream: the render reads every series with a seen-set (the
    # first live copy wins); later renders follow the fleet as it changes and the clash ends.
    state = rich_state()
    cache = ScrapeCache()
    check(cache, state.view(NOW), False)
    snap = state.snapshot("node-1")
    assert snap is not None
    clash = msgspec.structs.replace(
        snap, seq=snap.seq + 1, collector=msgspec.structs.replace(snap.collector, node_rank=0)
    )
    state.update(clash, NOW)
    body = check(cache, state.view(NOW), False)
    assert body.count(b'kvobserve_kv_blocks{dp_rank="1",medium="GPU",node_rank="0"') == 1
    check(cache, state.view(NOW + 1), True)
    state.update(msgspec.structs.replace(snap, seq=snap.seq + 2), NOW + 1)  # node_rank 1 again
    check(cache, state.view(NOW + 1), False)
