"""A prometheus_client Collector that reads the FleetView at scrape time; nothing per event.

Its families, written by prometheus_client's encoders, are the reference /metrics: the cached
text (export/scrape.py) is tested byte for byte against them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvobserve.analysis.fleet import FleetState
from kvobserve.analysis.views import FleetView
from kvobserve.export.catalog import BY_NAME, CATALOG
from kvobserve.export.exposition import cumulative
from kvobserve.export.metrics_docs import render_docs
from kvobserve.export.passthrough import passthrough
from kvobserve.export.series import EMPTY, Detail, Plan, groups, ordered
from kvobserve.transport import Transport, TransportStatus

ViewProvider = Callable[[], FleetView]
ExtraProvider = Callable[[], Iterable[Metric]]


def rest_families(view: FleetView, extra: Sequence[Metric], taken: set[str]) -> list[Metric]:
    """Extras, then passthrough families, each name once and none already in `taken`."""
    rest = []
    taken = set(taken)
    for m in [*extra, *passthrough(view)]:
        if m.name not in taken:  # a repeated family name would make the whole scrape invalid
            taken.add(m.name)
            rest.append(m)
    return rest


class FleetCollector(Collector):
    """Builds every catalog family from the current FleetView, plus passthrough and extras.

    By default per-stream block counters, event counters and lifetime histograms are summed
    per worker (the series budget); `per_stream_detail` serves them per stream instead, and the
    cache-analytics detail families besides.
    """

    def __init__(
        self,
        view_provider: ViewProvider,
        extra: ExtraProvider | None = None,
        *,
        per_stream_detail: bool = False,
        shard: str = "",
    ) -> None:
        self._view = view_provider
        self._extra = extra
        self.detail = Detail(per_stream_detail, shard)
        self._plan = Plan(self.detail)

    def take(self) -> tuple[FleetView, list[Metric]]:
        """The view and the extras now (on the event loop: the fleet state lives there)."""
        return self._view(), list(self._extra()) if self._extra is not None else []

    def collect(self) -> Iterable[Metric]:
        """Metric families of one scrape."""
        v, extra = self.take()
        out = fleet_metrics(self._plan, v)
        return out + rest_families(v, extra, {m.name for m in out})


def fleet_metrics(plan: Plan, v: FleetView) -> list[Metric]:
    """The catalog families of the view with samples, in catalog order (a repeated label set
    is served once: the first live copy)."""
    order = ordered(v)
    by_c = groups(v)
    batch = plan.batch([(c, by_c.get(c.info.collector_id, EMPTY)) for c in order], set())
    level = plan.fleet(v, order, batch.summed)
    out = []
    for d in CATALOG:
        cols = [col for col in (level.get(d.name), batch.columns.get(d.name)) if col is not None]
        if not cols:
            continue
        m = Metric(d.family, d.help, d.type)
        names = plan.names[d.name]
        for col in cols:
            for labels, value in zip(col.labels, col.values, strict=True):
                ls = dict(zip(names, labels, strict=True))
                if d.type != "histogram":  # a flag (up, complete, ...) as 1 or 0, for OTLP too
                    m.add_sample(d.name, ls, int(value) if type(value) is bool else value)
                    continue
                cum, top = cumulative(value)
                for bound, n in zip(value.bounds, cum, strict=False):
                    m.add_sample(f"{d.name}_bucket", {**ls, "le": floatToGoString(bound)}, n)
                m.add_sample(f"{d.name}_bucket", {**ls, "le": "+Inf"}, top)
                m.add_sample(f"{d.name}_count", ls, top)
                m.add_sample(f"{d.name}_sum", ls, value.sum)
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
    shard: str = "",
) -> list[Metric]:
    """The aggregator's own counters (snapshots, decode errors, NATS), for `extra`; one of
    several shards labels them with its `shard`."""
    sh = {"shard": shard} if shard else {}
    out = []
    if nats is not None:
        c = nats.counters
        up = 1.0 if nats.status is TransportStatus.CONNECTED else 0.0
        out = [
            catalog_metric("kvobserve_nats_connected", [(sh, up)]),
            catalog_metric("kvobserve_nats_snapshots_received_total", [(sh, c.received)]),
            catalog_metric("kvobserve_nats_reconnects_total", [(sh, c.reconnects)]),
            catalog_metric(
                "kvobserve_nats_dropped_total",
                [({"reason": r, **sh}, n) for r, n in sorted(c.dropped.items())],
            ),
        ]
    return [
        *out,
        catalog_metric(
            "kvobserve_aggregator_snapshots_applied_total", [(sh, state.snapshots_applied)]
        ),
        catalog_metric(
            "kvobserve_aggregator_snapshots_ignored_total", [(sh, state.snapshots_ignored)]
        ),
        catalog_metric(
            "kvobserve_aggregator_snapshot_decode_errors_total",
            [({"reason": r, **sh}, n) for r, n in sorted((decode_errors or {}).items())],
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
