"""The catalog's rows as export/series.py reads them: functions of typed items, read in C where
they only read attributes; labels a scope's items do not have refused when the plan is made."""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import pytest

from kvobserve.analysis.views import StreamView
from kvobserve.export.catalog import CATALOG, From, MetricDef, Scope
from kvobserve.export.series import Detail, Plan, _Row, labels_of, reader
from kvobserve.wire.snapshot import CollectorInfo, MediumStats, StreamStats

STATS = StreamStats("w", 3, gaps=7, up=True, media=[MediumStats("GPU", 5, 80)])
VIEW = StreamView(STATS, CollectorInfo("c"), True, 40.0, 80)


def test_a_function_that_only_reads_attributes_is_read_as_attrgetter() -> None:
    for fn, want in (
        (lambda s: s.stats.gaps, 7),
        (lambda s: s.over_capacity, True),  # a property: still an attribute read
        (lambda s: s.collector.collector_id, "c"),
    ):
        got = reader(fn)
        assert type(got) is attrgetter, fn
        assert got(VIEW) == fn(VIEW) == want


def test_any_other_function_is_kept() -> None:
    """A branch, a comparison, a call, arithmetic or the item itself: not a path (the function
    is called per item, with the same values)."""
    for fn in (
        lambda s: s.stats.gaps if s.up else 0,
        lambda s: int(s.stats.state == "up"),
        lambda s: s.stats.events.get("stored", 0),
        lambda s: s.stats.gaps + 1,
        lambda s: bool(s.stats.gaps or s.stats.lost),
        lambda s: s,
        lambda s: s.stats.media[0],
        # an identity test reads like a path to anything that only watches attribute reads
        # (seen: a None checkpoint part read as `snapshot.checkpoint.failing`)
        lambda s: s.snapshot.checkpoint.failing if s.snapshot.checkpoint is not None else {},
        lambda s, default=0: s.stats.gaps,
    ):
        assert reader(fn) is fn


def test_every_row_is_made_for_every_switch() -> None:
    """Every label a row serves is its scope's or its own: a Plan is made in each setting (an
    unknown label fails here, not at a scrape)."""
    for detail in (Detail(), Detail(per_stream_detail=True), Detail(shard="2")):
        plan = Plan(detail)
        assert plan.rows
    assert labels_of(Scope.RELAY) == {"target", "worker_id", "dp_rank", "endpoint", "collector",
                                      "node_rank"}  # fmt: skip


def test_a_label_the_scope_lacks_is_refused_when_the_plan_is_made() -> None:
    m = MetricDef("kvobserve_x", "gauge", ("worker_id", "target"), "x", From(Scope.BIND, 1))
    assert isinstance(m.source, From)
    with pytest.raises(ValueError, match=r"kvobserve_x: labels \['target'\] .*Scope.BIND"):
        _Row(m, m.source, Detail())
    ok = MetricDef("kvobserve_x", "gauge", ("worker_id", "target"), "x", From(Scope.RELAY, 1))
    assert isinstance(ok.source, From)
    _Row(ok, ok.source, Detail())


def _functions(src: From[Any]) -> list[Any]:
    out: list[Any] = [f for _, f in (*src.fixed, *src.labels)]
    out += [f for f in (src.value, src.each) if callable(f)]
    return out


def test_the_per_stream_rows_read_their_values_in_c() -> None:
    """The rows read per stream and storage tier (most of a scrape's samples) name attribute
    paths only, so the cost per sample stays in C (benchmarks/scale.py)."""
    for m in CATALOG:
        src = m.source
        if isinstance(src, From) and src.scope in (Scope.STREAM, Scope.MEDIUM):
            for fn in _functions(src):
                assert type(reader(fn)) is attrgetter, m.name


def test_a_relay_is_an_item_of_its_own() -> None:
    """The relay rows read relays, which only bound endpoints that have one hold."""
    relay_rows = [m for m in CATALOG if m.name.startswith("kvobserve_relay_")]
    assert relay_rows
    for m in relay_rows:
        assert isinstance(m.source, From) and m.source.scope is Scope.RELAY, m.name
