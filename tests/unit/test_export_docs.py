"""docs/metrics.md is generated from the catalog, and the catalog covers every family served."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path

from prometheus_client import CollectorRegistry

from kvobserve.analysis.fleet import FleetState
from kvobserve.export.catalog import BY_FAMILY, BY_NAME
from kvobserve.export.metrics_docs import render_docs
from kvobserve.export.prometheus import FleetCollector, aggregator_metrics, main
from kvobserve.transport.local import LocalBus
from tests.design_contract import DESIGN_METRICS
from tests.unit.test_export_fleet import rich_view

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def test_docs_file_is_the_generated_text() -> None:
    assert DOCS.read_text() == render_docs(), (
        "docs/metrics.md is stale: python -m kvobserve.export.prometheus --docs > docs/metrics.md"
    )


def test_docs_command_prints_the_same_text() -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["--docs"]) == 0
    assert out.getvalue() == render_docs()


def test_every_served_kvobserve_family_is_in_the_catalog_and_the_docs() -> None:
    r = CollectorRegistry()
    view = rich_view()
    bus = LocalBus()  # stands in for the NATS transport: same counters and status
    r.register(
        FleetCollector(lambda: view, lambda: aggregator_metrics(FleetState(), {"x": 1}, bus))
    )
    served = {f.name for f in r.collect() if f.name.startswith("kvobserve_")}
    # the opt-in families (docs/metrics.md, series budget) with per_stream_detail
    r2 = CollectorRegistry()
    r2.register(FleetCollector(lambda: view, per_stream_detail=True))
    served |= {f.name for f in r2.collect() if f.name.startswith("kvobserve_")}
    assert served - set(BY_FAMILY) == set()
    docs = render_docs()
    for fam in served:
        assert f"`{BY_FAMILY[fam].name}`" in docs
    # The rich fleet exercises the whole catalog, so no family in the docs goes unserved.
    assert set(BY_FAMILY) - served == set()


def test_nats_self_metrics_follow_the_transport() -> None:
    bus = LocalBus()
    bus.counters.received, bus.counters.reconnects = 7, 2
    bus.counters.drop("buffer_full")
    r = CollectorRegistry()
    r.register(
        FleetCollector(lambda: rich_view(), lambda: aggregator_metrics(FleetState(), {}, bus))
    )
    assert r.get_sample_value("kvobserve_nats_connected") == 1.0
    assert r.get_sample_value("kvobserve_nats_snapshots_received_total") == 7.0
    assert r.get_sample_value("kvobserve_nats_reconnects_total") == 2.0
    assert r.get_sample_value("kvobserve_nats_dropped_total", {"reason": "buffer_full"}) == 1.0


def test_the_catalog_serves_every_metric_design_md_names() -> None:
    assert set(DESIGN_METRICS) - set(BY_NAME) == set()
