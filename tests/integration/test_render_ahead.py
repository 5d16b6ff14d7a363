"""Render-ahead over real HTTP on 127.0.0.1: a steady scraper's bodies are ready when it comes."""

from __future__ import annotations

import asyncio
import gzip
import time
import urllib.request

import pytest

from kvobserve.analysis.fleet import FleetState
from kvobserve.export.server import AHEAD, HttpServer, create_app, serve
from kvobserve.wire.snapshot import Snapshot, StreamStats
from tests.unit.test_export_fleet import NOW, rich_state

pytestmark = pytest.mark.integration
INTERVAL_S = 1.2  # a steady scraper (render-ahead needs >= 1 s), paced by the clock
FRESH = 'kvobserve_kv_event_batches_total{dp_rank="2",node_rank="1",worker_id="sglang-a"} 77.0'


async def _start(state: FleetState, render_ahead_s: float) -> HttpServer:
    return await serve(
        create_app(lambda: state.view(NOW), render_ahead_s=render_ahead_s), "127.0.0.1:0"
    )


def _scrape(url: str) -> bytes:
    """One gzip scrape, as Prometheus asks; the plain body."""
    req = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return gzip.decompress(r.read())


def _newer(state: FleetState) -> None:
    """A new snapshot from node-1: rank 2 has published 77 batches."""
    snap = state.snapshot("node-1")
    newer = Snapshot(snap.collector, seq=snap.seq + 1, time=NOW, workers=snap.workers)
    newer.streams = [StreamStats("sglang-a", 2, up=True, batches_total=77)]
    assert state.update(newer, NOW)


async def test_a_steady_scraper_is_served_ahead_with_fresh_values() -> None:
    state = rich_state()
    srv = await _start(state, 2.0)
    ref = await _start(state, 0.0)  # renders on request only
    served = srv.runner.app[AHEAD].served
    try:
        url = f"{srv.url}/metrics"
        t0 = time.monotonic()
        updated = done = False
        for k in range(12):  # bounded: a loaded machine may break the steadiness once or twice
            await asyncio.sleep(max(0.0, t0 + k * INTERVAL_S - time.monotonic()))
            before = served["on_request"]
            body = await asyncio.to_thread(_scrape, url)
            if served["on_request"] != before:
                continue
            if updated:  # rendered ahead after the update: the new value is in it
                assert FRESH in body.decode()
                assert body == await asyncio.to_thread(_scrape, f"{ref.url}/metrics")
                done = True
                break
            assert FRESH not in body.decode()
            _newer(state)
            updated = True
        assert done, f"no two requests served ahead in a row: {served}"
        assert served["on_request"] >= 3  # the first ones: not steady yet
        assert srv.runner.app[AHEAD].lead < 2.0
    finally:
        await srv.close()
        await ref.close()


async def test_fast_polling_is_always_rendered_on_request() -> None:
    state = rich_state()
    srv = await _start(state, 2.0)
    served = srv.runner.app[AHEAD].served
    try:
        url = f"{srv.url}/metrics"
        for k in range(6):
            body = await asyncio.to_thread(_scrape, url)
            assert (FRESH in body.decode()) == (k > 2)
            if k == 2:
                _newer(state)  # the next poll sees it at once
        assert served == {"ahead": 0, "in_flight": 0, "on_request": 6}
    finally:
        await srv.close()
