"""OTLP/HTTP push of the catalog's series (same names and labels as /metrics) with the OTel SDK."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource

from kvobserve import __version__
from kvobserve.aio import cancel_and_wait
from kvobserve.export.catalog import BY_FAMILY, CATALOG
from kvobserve.export.prometheus import ExtraProvider, FleetCollector, ViewProvider

log = logging.getLogger(__name__)
Series = list[tuple[dict[str, str], float]]


def metrics_url(endpoint: str) -> str:
    """A base URL gets the OTLP metrics path; a URL with a path is used as given."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"otlp-endpoint: {endpoint!r} is not an http(s) URL")
    if parts.path in ("", "/"):
        parts = parts._replace(path="/v1/metrics")
    return urlunsplit(parts)


class _CountingExporter(OTLPMetricExporter):
    """OTLPMetricExporter that counts its results (the reader swallows them)."""

    ok = 0
    failed = 0

    def export(
        self, metrics_data: MetricsData, timeout_millis: float | None = 10_000, **kw: Any
    ) -> MetricExportResult:
        result = super().export(metrics_data, timeout_millis, **kw)
        if result == MetricExportResult.SUCCESS:
            self.ok += 1
        else:
            self.failed += 1
        return result


class OtlpPush:
    """Pushes the fleet every interval; the view is read on the event loop, the POST in a thread."""

    def __init__(
        self,
        view_provider: ViewProvider,
        endpoint: str,
        interval_s: float,
        *,
        headers: dict[str, str] | None = None,
        timeout_s: float = 10.0,
        extra: ExtraProvider | None = None,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"otlp interval_s: {interval_s!r} must be > 0")
        self.endpoint = metrics_url(endpoint)
        self.interval_s = interval_s
        self._timeout_ms = timeout_s * 1000
        self._collector = FleetCollector(view_provider, extra)
        # Callbacks run in the export thread; they only read this dict, swapped whole on the loop.
        self._latest: dict[str, Series] = {}
        self._exporter = _CountingExporter(
            endpoint=self.endpoint, headers=headers, timeout=timeout_s
        )
        # An infinite interval: no reader thread; the asyncio task below drives every push.
        self._reader = PeriodicExportingMetricReader(
            self._exporter, export_interval_millis=math.inf
        )
        self._provider = MeterProvider(
            metric_readers=[self._reader],
            resource=Resource.create({"service.name": "kvobserve", "service.version": __version__}),
            shutdown_on_exit=False,
        )
        meter = self._provider.get_meter("kvobserve", __version__)
        for d in CATALOG:
            if d.type == "histogram":
                continue  # not sent over OTLP (documented in docs/metrics.md)
            cb = [self._callback(d.name)]
            if d.type == "counter":
                meter.create_observable_counter(d.name, callbacks=cb, description=d.help)
            else:
                meter.create_observable_gauge(d.name, callbacks=cb, description=d.help)
        self._task: asyncio.Task[None] | None = None

    @property
    def pushes_ok(self) -> int:
        """Successful exports so far."""
        return self._exporter.ok

    @property
    def pushes_failed(self) -> int:
        """Failed exports so far (the receiver was down or refused)."""
        return self._exporter.failed

    def _callback(self, name: str) -> Any:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(v, labels) for labels, v in self._latest.get(name, ())]

        return observe

    def refresh(self) -> None:
        """Render the view now (on the loop thread) for the next push."""
        latest: dict[str, Series] = {}
        for fam in self._collector.collect():
            d = BY_FAMILY.get(fam.name)
            if d is None or d.type == "histogram":
                continue
            for s in fam.samples:
                if s.name == d.name:
                    latest.setdefault(d.name, []).append((dict(s.labels), s.value))
        self._latest = latest

    async def push_once(self) -> None:
        """Refresh and export once."""
        self.refresh()
        await asyncio.to_thread(self._reader.force_flush, self._timeout_ms)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.push_once()
            except Exception:  # a failing push must not end the loop
                log.exception("otlp push to %s failed", self.endpoint)
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))

    def start(self) -> OtlpPush:
        """Start the push task on the running loop; returns self."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="otlp-push")
        return self

    async def shutdown(self) -> None:
        """Stop pushing and release the exporter (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
            await asyncio.to_thread(self._provider.shutdown, self._timeout_ms)


def parse_headers(items: Sequence[str]) -> dict[str, str]:
    """['k=v', ...] (e.g. --otlp-header) -> dict; ValueError names the bad item."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"otlp-header: {item!r} is not key=value")
        out[key.strip()] = value.strip()
    return out
