"""The aiohttp server on 127.0.0.1: routes, content negotiation, auth, TLS, limits, promtool."""

from __future__ import annotations

import asyncio
import base64
import gzip
import shutil
import ssl
import subprocess
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest

from kvobserve.analysis.fleet import FleetState
from kvobserve.export.server import (
    HttpServer,
    accepts_gzip,
    create_app,
    make_ssl_context,
    parse_listen,
    serve,
)
from kvobserve.wire.snapshot import CollectorInfo, Snapshot, StreamStats, WorkerInfo
from tests.certs import self_signed
from tests.unit.test_export_fleet import NOW, rich_state

pytestmark = pytest.mark.integration


async def _start(state: FleetState, tls: ssl.SSLContext | None = None, **kw: object) -> HttpServer:
    app = create_app(lambda: state.view(NOW), **kw)  # type: ignore[arg-type]
    return await serve(app, "127.0.0.1:0", tls)


@pytest.fixture
async def rich() -> AsyncIterator[tuple[HttpServer, FleetState]]:
    state = rich_state()
    srv = await _start(state)
    try:
        yield srv, state
    finally:
        await srv.close()


async def _get(url: str, **kw: object) -> tuple[int, dict[str, str], str]:
    async with aiohttp.ClientSession() as s, s.get(url, **kw) as r:  # type: ignore[arg-type]
        return r.status, dict(r.headers), await r.text()


async def test_metrics_text_and_openmetrics(rich: tuple[HttpServer, FleetState]) -> None:
    srv, _ = rich
    status, headers, body = await _get(f"{srv.url}/metrics")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    line = 'kvobserve_kv_event_batches_total{dp_rank="0",node_rank="0",worker_id="sglang-a"} 100.0'
    assert line in body.splitlines()
    accept = "application/openmetrics-text; version=1.0.0, text/plain;q=0.5"
    status, headers, body = await _get(f"{srv.url}/metrics", headers={"Accept": accept})
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.endswith("# EOF\n")


def _raw(url: str, headers: dict[str, str]) -> tuple[dict[str, str], bytes]:
    """GET without any decoding of the body (aiohttp's client would gunzip it)."""
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
        return dict(r.headers), r.read()


@pytest.mark.parametrize("accept", ["", "application/openmetrics-text; version=1.0.0"])
async def test_metrics_gzip_when_asked(rich: tuple[HttpServer, FleetState], accept: str) -> None:
    srv, _ = rich
    url = f"{srv.url}/metrics"
    plain_h, plain = await asyncio.to_thread(_raw, url, {"Accept": accept})
    assert "Content-Encoding" not in plain_h and plain_h["Vary"] == "Accept-Encoding"
    for enc in ("gzip", "deflate, gzip;q=1.0, *;q=0.5", "*"):  # what Prometheus and curl send
        headers, packed = await asyncio.to_thread(
            _raw, url, {"Accept": accept, "Accept-Encoding": enc}
        )
        assert headers["Content-Encoding"] == "gzip", enc
        assert gzip.decompress(packed) == plain
        assert len(packed) < len(plain)
    for enc in ("gzip;q=0", "identity", "br"):
        headers, body = await asyncio.to_thread(
            _raw, url, {"Accept": accept, "Accept-Encoding": enc}
        )
        assert "Content-Encoding" not in headers and body == plain, enc


async def test_metrics_uncached_renderer_serves_the_same(
    rich: tuple[HttpServer, FleetState],
) -> None:
    srv, state = rich
    old = await _start(state, scrape_cache=False)
    try:
        for enc in ("", "gzip"):
            _, new_body = await asyncio.to_thread(
                _raw, f"{srv.url}/metrics", {"Accept-Encoding": enc}
            )
            _, old_body = await asyncio.to_thread(
                _raw, f"{old.url}/metrics", {"Accept-Encoding": enc}
            )
            if enc:
                new_body, old_body = gzip.decompress(new_body), gzip.decompress(old_body)
            assert new_body == old_body
    finally:
        await old.close()


def test_accepts_gzip() -> None:
    assert accepts_gzip("gzip") and accepts_gzip("GZip, deflate") and accepts_gzip("*")
    assert accepts_gzip("x-gzip") and accepts_gzip("gzip;q=0.1")
    assert not accepts_gzip("") and not accepts_gzip("gzip;q=0") and not accepts_gzip("br")
    assert not accepts_gzip("*, gzip;q=0") and not accepts_gzip("gzip;q=bogus")


async def test_metrics_follow_the_state_at_scrape_time(rich: tuple[HttpServer, FleetState]) -> None:
    srv, state = rich
    snap = state.snapshot("node-1")
    newer = Snapshot(snap.collector, seq=snap.seq + 1, time=NOW, workers=snap.workers)
    newer.streams = [StreamStats("sglang-a", 2, up=True, batches_total=77)]
    assert state.update(newer, NOW)
    _, _, body = await _get(f"{srv.url}/metrics")
    assert (
        'kvobserve_kv_event_batches_total{dp_rank="2",node_rank="1",worker_id="sglang-a"} 77.0'
        in body
    )


async def test_promtool_accepts_a_live_scrape(rich: tuple[HttpServer, FleetState]) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: run scripts/install-tools.sh (Debian package prometheus)"
    srv, _ = rich
    _, _, body = await _get(f"{srv.url}/metrics")
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


async def test_health_api_and_status_page(rich: tuple[HttpServer, FleetState]) -> None:
    srv, _ = rich
    assert (await _get(f"{srv.url}/healthz"))[0] == 200
    assert (await _get(f"{srv.url}/readyz"))[0] == 200
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{srv.url}/api/v1/streams") as r:
            streams = await r.json()
        async with s.get(f"{srv.url}/api/v1/alerts") as r:
            alerts = await r.json()
        async with s.get(f"{srv.url}/api/v1/fleet") as r:
            fleet = await r.json()
    s0 = next(s for s in streams if s["worker_id"] == "sglang-a" and s["dp_rank"] == 0)
    assert (s0["up"], s0["batches"], s0["gaps"], s0["lost"], s0["cache_usage_ratio"]) == (
        True,
        100,
        2,
        2,
        0.25,
    )
    stale = next(s for s in streams if s["collector"] == "node-2")
    assert (stale["up"], stale["batches"], stale["cache_usage_ratio"]) == (False, 50, None)
    dup = [a for a in alerts if a["kind"] == "duplicate_stream"]
    assert dup and dup[0]["labels"] == {
        "worker_id": "sglang-a",
        "node_rank": "0",
        "dp_rank": "0",
        "collector": "node-0",
    }
    assert alerts[0]["severity"] == "critical"
    worker = next(w for w in fleet["workers"] if w["worker_id"] == "sglang-a")
    assert worker["owners"] == {
        "0": ["node-0"],
        "1": ["node-0", "node-1"],
        "2": ["node-1"],
        "3": [],
    }
    status, headers, page = await _get(f"{srv.url}/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert 'http-equiv="refresh"' in page and "vllm-b" in page


async def test_readyz_503_before_any_snapshot_and_labels_escaped() -> None:
    state = FleetState()
    srv = await _start(state)
    try:
        status, _, body = await _get(f"{srv.url}/readyz")
        assert status == 503, body
        evil = "<script>alert(1)</script>"
        snap = Snapshot(
            CollectorInfo("n&0", 0, '"><img src=x>'),
            time=NOW,
            workers=[WorkerInfo(evil, dp_size=1, ranks_owned=[0])],
            streams=[StreamStats(evil, 0, endpoint="tcp://<i>", up=True)],
        )
        state.update(snap, NOW)
        assert (await _get(f"{srv.url}/readyz"))[0] == 200
        _, _, page = await _get(f"{srv.url}/")
        assert "<script>" not in page and "<img" not in page and "<i>" not in page
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "n&amp;0" in page
    finally:
        await srv.close()


async def test_request_bodies_and_other_methods_refused(
    rich: tuple[HttpServer, FleetState],
) -> None:
    srv, _ = rich
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{srv.url}/metrics", data=b"x" * 100) as r:
            assert r.status == 413
        async with s.post(f"{srv.url}/metrics") as r:
            assert r.status == 405


def _basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


async def test_basic_auth_guards_everything_but_the_probes() -> None:
    state = rich_state()
    srv = await _start(state, basic_auth=("ops", "s3cret"))
    try:
        status, headers, _ = await _get(f"{srv.url}/metrics")
        assert status == 401 and headers["WWW-Authenticate"].startswith("Basic ")
        wrong = _basic("ops", "nope")
        assert (await _get(f"{srv.url}/api/v1/streams", headers=wrong))[0] == 401
        assert (await _get(f"{srv.url}/", headers=wrong))[0] == 401
        garbage = {"Authorization": "Basic !!!"}
        assert (await _get(f"{srv.url}/metrics", headers=garbage))[0] == 401
        status, _, body = await _get(f"{srv.url}/metrics", headers=_basic("ops", "s3cret"))
        assert status == 200 and "kvobserve_stream_up" in body
        assert (await _get(f"{srv.url}/healthz"))[0] == 200
        assert (await _get(f"{srv.url}/readyz"))[0] == 200  # Kubernetes probes send no credentials
        assert (await _get(f"{srv.url}/api/v1/alerts"))[0] == 401
    finally:
        await srv.close()


async def test_tls(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    state = rich_state()
    srv = await _start(state, make_ssl_context(cert, key))
    try:
        assert srv.url.startswith("https://127.0.0.1:")
        client_ctx = ssl.create_default_context(cafile=cert)
        status, _, body = await _get(f"{srv.url}/metrics", ssl=client_ctx)
        assert status == 200 and "kvobserve_build_info" in body
        with pytest.raises(aiohttp.ClientError):
            await _get(f"http://127.0.0.1:{srv.port}/metrics")  # plain HTTP on a TLS port
    finally:
        await srv.close()


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (
            lambda: make_ssl_context("/nonexistent/c.pem", "/nonexistent/k.pem"),
            "/nonexistent/c.pem",
        ),
        (lambda: parse_listen("localhost"), "'localhost'"),
        (lambda: parse_listen("127.0.0.1:http"), "127.0.0.1:http"),
    ],
)
def test_bad_settings_name_the_value(call: Callable[[], object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        call()


def test_parse_listen() -> None:
    assert parse_listen("127.0.0.1:9477") == ("127.0.0.1", 9477)
    assert parse_listen("[::1]:0") == ("::1", 0)
    assert parse_listen(":9477") == ("0.0.0.0", 9477)


async def test_listen_error_names_the_address(rich: tuple[HttpServer, FleetState]) -> None:
    srv, state = rich
    with pytest.raises(OSError, match=f"127.0.0.1:{srv.port}"):
        await serve(create_app(lambda: state.view(NOW)), f"127.0.0.1:{srv.port}")
