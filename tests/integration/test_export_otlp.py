"""OTLP/HTTP push to a local receiver carries the same series and values that /metrics serves."""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality
from prometheus_client import CollectorRegistry

from kvobserve.export.catalog import BY_NAME
from kvobserve.export.otlp import OtlpPush, metrics_url, parse_headers
from kvobserve.export.prometheus import FleetCollector
from kvobserve.export.server import HttpServer, serve
from tests.polling import until_async
from tests.unit.test_export_fleet import rich_view

pytestmark = pytest.mark.integration

Key = tuple[str, tuple[tuple[str, str], ...]]


class Receiver:
    """A minimal OTLP/HTTP metrics receiver."""

    def __init__(self) -> None:
        self.requests: list[ExportMetricsServiceRequest] = []
        self.headers: list[dict[str, str]] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        msg = ExportMetricsServiceRequest()
        msg.ParseFromString(body)
        self.requests.append(msg)
        self.headers.append(dict(request.headers))
        return web.Response(body=b"", content_type="application/x-protobuf")


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[Receiver, HttpServer]]:
    rec = Receiver()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/metrics", rec.handle)
    srv = await serve(app, "127.0.0.1:0")
    try:
        yield rec, srv
    finally:
        await srv.close()


def _otlp_points(req: ExportMetricsServiceRequest) -> tuple[dict[Key, float], dict[str, str]]:
    points: dict[Key, float] = {}
    kinds: dict[str, str] = {}
    for rm in req.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                kind = m.WhichOneof("data")
                kinds[m.name] = kind or ""
                if kind == "sum":
                    assert m.sum.is_monotonic
                    assert (
                        m.sum.aggregation_temporality
                        == AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
                    )
                    dps = m.sum.data_points
                else:
                    dps = m.gauge.data_points
                for dp in dps:
                    attrs = tuple(sorted((a.key, a.value.string_value) for a in dp.attributes))
                    value = dp.as_double if dp.WhichOneof("value") == "as_double" else dp.as_int
                    points[(m.name, attrs)] = float(value)
    return points, kinds


def _prometheus_points() -> dict[Key, float]:
    reg = CollectorRegistry()
    view = rich_view()
    reg.register(FleetCollector(lambda: view))
    out: dict[Key, float] = {}
    for fam in reg.collect():
        for s in fam.samples:
            d = BY_NAME.get(s.name)
            if d is not None and d.type != "histogram":
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_otlp_push_matches_metrics(receiver: tuple[Receiver, HttpServer]) -> None:
    rec, srv = receiver
    view = rich_view()
    push = OtlpPush(lambda: view, srv.url, 0.2, headers={"x-tenant": "gpu-fleet"}).start()
    try:
        await until_async(lambda: len(rec.requests) >= 2, 20, "two OTLP pushes received")
    finally:
        await push.shutdown()
    assert len(rec.requests) >= 2, "no OTLP push arrived"
    assert push.pushes_ok >= 2 and push.pushes_failed == 0
    assert rec.headers[0]["x-tenant"] == "gpu-fleet"
    points, kinds = _otlp_points(rec.requests[-1])
    expected = _prometheus_points()
    assert points == expected
    assert kinds["kvobserve_kv_event_batches_total"] == "sum"
    assert kinds["kvobserve_kv_cache_usage_ratio"] == "gauge"
    assert "kvobserve_kv_block_lifetime_seconds" not in kinds  # histograms stay Prometheus-only
    key = (
        "kvobserve_kv_event_batches_total",
        (("dp_rank", "0"), ("node_rank", "0"), ("worker_id", "sglang-a")),
    )
    assert points[key] == 100
    res = {
        a.key: a.value.string_value
        for a in rec.requests[-1].resource_metrics[0].resource.attributes
    }
    assert res["service.name"] == "kvobserve"


async def test_otlp_push_survives_a_dead_receiver() -> None:
    # Port 9 (discard) on 127.0.0.1 is closed: every push fails, the task keeps running.
    push = OtlpPush(rich_view, "http://127.0.0.1:9", 0.1, timeout_s=0.5).start()
    try:
        await until_async(lambda: push.pushes_failed >= 2, 20, "two pushes failed")
        assert push.pushes_failed >= 2 and push.pushes_ok == 0
    finally:
        await push.shutdown()


def test_endpoint_and_header_parsing() -> None:
    assert metrics_url("http://otel:4318") == "http://otel:4318/v1/metrics"
    assert metrics_url("https://otel:4318/") == "https://otel:4318/v1/metrics"
    assert metrics_url("http://otel:4318/custom/path") == "http://otel:4318/custom/path"
    with pytest.raises(ValueError, match="'otel:4318'"):
        metrics_url("otel:4318")
    assert parse_headers(["a=b", "x-key = v=1"]) == {"a": "b", "x-key": "v=1"}
    with pytest.raises(ValueError, match="'novalue'"):
        parse_headers(["novalue"])
