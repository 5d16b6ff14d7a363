"""A prometheus_client Collector that renders the FleetView at scrape time; nothing per event."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvobserve.analysis.fleet import FleetState
from kvobserve.analysis.views import FleetView
from kvobserve.export.catalog import BY_NAME, render_docs
from kvobserve.export.exposition import Listed, MetricFamilies, TextFamilies
from kvobserve.export.passthrough import passthrough
from kvobserve.export.samples import Detail, fleet
from kvobserve.transport import Transport, TransportStatus

ViewProvider = Callable[[], FleetView]
ExtraProvider = Callable[[], Iterable[Metric]]


def render_exposition(
    view: FleetView,
    extra: Sequence[Metric],
    encoder: Callable[[Any], bytes],
    openmetrics: bool = False,
    detail: Detail | None = None,
) -> bytes:
    """The whole /metrics body, rendered afresh: catalog families here, extras and passthrough
    by `encoder` (prometheus_client's, from choose_encoder: it also writes OpenMetrics' # EOF).

    Same bytes as `encoder` over FleetCollector.collect() for the text format 0.0.4 and for
    OpenMetrics with legacy-valid names (every name here is). export/scrape.py writes the same
    bytes from per-collector text kept between snapshots.
    """
    f = TextFamilies()
    fleet(f, view, detail or Detail())
    head, taken = f.text(openmetrics)
    return head.encode() + encoder(Listed(rest_families(view, extra, taken)))


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
    per worker (the series budget); `per_stream_counters`/`per_stream_histograms` serve
    them per stream instead.
    """

    def __init__(
        self,
        view_provider: ViewProvider,
        extra: ExtraProvider | None = None,
        *,
        per_stream_histograms: bool = False,
        per_stream_counters: bool = False,
        shard: str = "",
    ) -> None:
        self._view = view_provider
        self._extra = extra
        self.detail = Detail(per_stream_histograms, per_stream_counters, shard)

    def take(self) -> tuple[FleetView, list[Metric]]:
        """The view and the extras now (on the event loop: the fleet state lives there)."""
        return self._view(), list(self._extra()) if self._extra is not None else []

    def exposition(
        self, encoder: Callable[[Any], bytes], openmetrics: bool = False
    ) -> Callable[[], bytes]:
        """Take the view and the extras now; the returned function renders the body (any thread)."""
        v, extra = self.take()
        return partial(render_exposition, v, extra, encoder, openmetrics, self.detail)

    def collect(self) -> Iterable[Metric]:
        """Metric families of one scrape."""
        f = MetricFamilies()
        v, extra = self.take()
        fleet(f, v, self.detail)
        out = [m for m in f.metrics.values() if m.samples]
        return out + rest_families(v, extra, {m.name for m in out})


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
