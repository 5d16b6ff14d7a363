"""Hardening: cardinality caps end to end, HTTP request limits, collect + aggregate over NATS with
mutual TLS and a password, pickle refusal on a real socket.

Basic auth and TLS on /metrics are in test_export_server.py; hostile wire input in
test_fault_wire.py (see docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import pickle
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

import kvobserve.collector as collector_mod
from kvobserve.aggregator import Aggregator
from kvobserve.analysis.fleet import FleetState
from kvobserve.collector import Collector
from kvobserve.commands.common import start_http
from kvobserve.config import HttpConfig
from kvobserve.export.server import create_app, serve
from kvobserve.simulate.encoders import encode_batch, get_format
from kvobserve.simulate.ports import free_port, free_port_range
from kvobserve.sources.ingest_options import IngestOptions
from tests.integration.collector_helpers import (
    Sims,
    capture_publisher,
    collector_config,
    running_collector,
    wait_snapshot,
)
from tests.integration.conftest import NatsServer
from tests.integration.fleet_helpers import Procs, Scrape, clean_env
from tests.integration.test_fault_fleet import aggregate, collected, collector_toml, engine
from tests.integration.test_nats_transport import _make_pki
from tests.polling import until, until_async
from tests.unit.test_export_fleet import NOW, rich_state

pytestmark = pytest.mark.integration


# --- cardinality caps, end to end: collector snapshot -> bus -> aggregator -> /metrics ----------


@asynccontextmanager
async def exported(col: Collector) -> AsyncIterator[str]:
    """An aggregator on the collector's bus, serving /metrics; yields the URL."""
    agg = Aggregator(FleetState())
    await agg.start(col.transport)
    port = free_port()
    stop = await start_http(agg, HttpConfig(f"127.0.0.1:{port}"))
    try:
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        await stop()
        await agg.stop()


async def scrape_until(url: str, check: Any, what: str, timeout_s: float = 10.0) -> Scrape:
    """Scrape until `check(scrape)` holds."""
    async with aiohttp.ClientSession() as http:

        async def scraped() -> Scrape | None:
            async with http.get(url) as r:
                s = Scrape.parse(await r.text())
            return s if check(s) else None

        got: Scrape = await until_async(scraped, timeout_s, what)
        return got


def refused(s: Scrape) -> dict[tuple[str, ...], float]:
    return s.by("kvobserve_collector_refused_total", ("what",), collector="c0")


async def test_stream_cap_refuses_ranks_and_probes_and_says_so() -> None:
    base = free_port_range("127.0.0.1", 4)
    # 3 ranks + 1 probe port = 4 streams; the cap is 2
    cfg = collector_config("vllm", kv_endpoint=f"tcp://127.0.0.1:{base}", dp_size=3)
    async with running_collector(cfg, ingest=IngestOptions(max_streams=2)) as col:
        snap = await col.snapshot()
        assert snap.refused == {"streams": 2}
        assert [s.dp_rank for s in snap.streams] == [0, 1] and snap.unexpected == []
        async with exported(col) as url:
            s = await scrape_until(url, refused, "refusals exported")
            assert refused(s) == {("streams",): 2.0}
            assert set(s.by("kvobserve_stream_info", ("dp_rank",))) == {("0",), ("1",)}
            assert s.get("kvobserve_kv_unexpected_stream") == []


async def test_media_past_the_cap_are_refused_event_by_event() -> None:
    fmt = get_format("vllm-0.33")
    media = [f"tier{i:02d}" for i in range(12)]  # 8 are accepted (BlockIndex max_media)
    first = [fmt.stored([100 + i], None, [1, 2], 16, m) for i, m in enumerate(media)]
    second = [fmt.stored([200], None, [1, 2], 16, "tier11"), fmt.stored([201], None, [1], 16, "tier00")]  # fmt: skip
    with capture_publisher([0]) as pub:
        cfg = collector_config("vllm", kv_endpoint=pub.endpoint, dp_size=1, probe_extra_ports=0)
        async with running_collector(cfg) as col, exported(col) as url:
            await pub.wait_subscribed()
            for seq, events in enumerate((first, second)):
                pub.send(0, [b"", seq.to_bytes(8, "big"), encode_batch(time.time(), events, 0)])
            snap = await wait_snapshot(col, lambda s: s.streams[0].batches_total == 2)
            assert snap.refused == {"medium_events": 5}  # tier08-11, then tier11 again
            s = await scrape_until(url, lambda s: refused(s) == {("medium_events",): 5.0}, "5")
            blocks = s.by("kvobserve_kv_blocks", ("medium",), worker_id="w")
            assert blocks == {(m,): 2.0 if m == "tier00" else 1.0 for m in media[:8]}


async def test_passthrough_cap_keeps_whole_families_and_counts_per_scrape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(collector_mod, "MAX_PASSTHROUGH_SAMPLES", 4)
    body = "\n".join(
        ["# TYPE sglang:num_running_reqs gauge"]
        + [f'sglang:num_running_reqs{{dp_rank="{r}"}} {r + 3}' for r in (0, 1)]
        + ["# TYPE engine_big gauge"]  # 10 samples: more than the room left (2)
        + [f'engine_big{{i="{i}"}} {i}' for i in range(10)]
        + ["# TYPE engine_small gauge", "engine_small 7", ""]
    )

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=body)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    engine = await serve(app, "127.0.0.1:0")
    try:
        cfg = collector_config(
            "sglang", kv_endpoint=f"tcp://127.0.0.1:{free_port()}", dp_size=2,
            metrics_url=f"{engine.url}/metrics", passthrough_engine_metrics=True, interval_s=0.3,
        )  # fmt: skip
        async with running_collector(cfg) as col, exported(col) as url:
            scrape = col.scheduler["w"].scrape
            assert scrape is not None
            seen = 0
            while seen < 3:  # three engine scrapes: the counter grows by 10 per scrape
                n = scrape.messages_total
                snap = await col.snapshot()
                if n and scrape.messages_total == n:  # no scrape landed while we looked
                    assert snap.refused == {"passthrough_samples": 10 * n}
                    assert [f.name for f in snap.passthrough] == ["sglang:num_running_reqs", "engine_small"]  # fmt: skip
                    seen = n
                await asyncio.sleep(0.02)  # polling interval, not synchronization
            s = await scrape_until(url, lambda s: refused(s).get(("passthrough_samples",), 0) >= 30, "30")  # fmt: skip
            assert s.by("sglang_num_running_reqs", ("dp_rank", "worker_id", "node_rank")) == {
                ("0", "w", "0"): 3.0,
                ("1", "w", "0"): 4.0,
            }
            assert s.by("engine_small", ("worker_id",)) == {("w",): 7.0}
            assert s.get("engine_big") == []
    finally:
        await engine.close()


# --- HTTP request limits -----------------------------------------------------------------------


async def test_http_refuses_bodies_odd_methods_and_huge_headers_and_keeps_serving() -> None:
    state = rich_state()
    srv = await serve(create_app(lambda: state.view(NOW)), "127.0.0.1:0")
    url = f"{srv.url}/metrics"

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(160):  # 10 MiB, chunked: refused by the headers, not after buffering
            yield b"x" * 65536

    try:
        async with aiohttp.ClientSession() as http:
            t0 = time.monotonic()
            async with http.get(url, data=chunks()) as r:
                assert r.status == 413
            assert time.monotonic() - t0 < 2.0
            for path in ("/", "/healthz", "/api/v1/streams"):
                async with http.get(f"{srv.url}{path}", data=b"{}") as r:
                    assert r.status == 413, path
            for method in ("PUT", "DELETE", "PATCH", "OPTIONS", "TRACE"):
                async with http.request(method, url) as r:
                    assert r.status == 405, method
            async with http.request("BREW", url) as r:
                assert r.status == 400
            async with http.get(url, headers={"X-Big": "a" * 100_000}) as r:
                assert r.status == 400
            async with http.get(f"{srv.url}/../etc/passwd") as r:
                assert r.status == 404
            async with http.get(url) as r:
                assert r.status == 200 and "kvobserve_stream_up" in await r.text()
    finally:
        await srv.close()


async def test_many_concurrent_scrapes_and_idle_connections_do_not_break_metrics() -> None:
    state = rich_state()
    srv = await serve(create_app(lambda: state.view(NOW)), "127.0.0.1:0")
    idle: list[asyncio.StreamWriter] = []
    try:
        for _ in range(100):  # half-sent requests that never finish (slowloris)
            _, w = await asyncio.open_connection("127.0.0.1", srv.port)
            w.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            idle.append(w)
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as http:

            async def one() -> tuple[int, str]:
                async with http.get(f"{srv.url}/metrics") as r:
                    return r.status, await r.text()

            t0 = time.monotonic()
            results = await asyncio.gather(*(one() for _ in range(200)))
            took = time.monotonic() - t0
        bodies = {body for _, body in results}
        assert [s for s, _ in results] == [200] * 200
        assert len(bodies) == 1, "every scrape of one state is the same exposition"
        Scrape.parse(bodies.pop())
        assert took < 30, f"200 concurrent scrapes took {took:.1f} s"
    finally:
        for w in idle:
            w.close()
        await srv.close()


# --- pickle: refused by default; opt-in loads KvMetrics and nothing else -------------------------


class _Evil:
    """A pickle that would create `path` when loaded by a plain unpickler."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def _kv_metrics_pickle() -> bytes:
    """A KvMetrics pickled as SGLang's plain class would be (written by hand: protocol 2)."""
    mod = b"sglang.srt.managers.scheduler_components.kv_events_publisher"
    state = {"request_active_slots": 3, "request_total_slots": 48, "kv_active_blocks": 100,
             "kv_total_blocks": 4096, "num_requests_waiting": 2, "gpu_cache_usage_perc": 0.25,
             "gpu_prefix_cache_hit_rate": 0.5, "data_parallel_rank": 0}  # fmt: skip
    body = pickle.dumps(state, protocol=2)[2:-1]  # the dict, without PROTO and STOP
    return b"\x80\x02c" + mod + b"\nKvMetrics\n)\x81" + body + b"b."


async def _push(endpoint: str, payloads: list[bytes]) -> None:
    ctx = zmq.asyncio.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(endpoint)
    try:
        for p in payloads:
            await push.send(p)
    finally:
        push.close()
        ctx.term()


@pytest.mark.parametrize("allow_pickle", [False, True], ids=["default", "opt-in"])
async def test_a_malicious_pickle_over_push_pull_is_refused_and_nothing_runs(
    allow_pickle: bool, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    cfg = collector_config(
        "sglang", kv_endpoint=f"tcp://127.0.0.1:{free_port()}", dp_size=1, probe_extra_ports=0,
        kv_metrics_endpoint=endpoint, allow_pickle=allow_pickle,
    )  # fmt: skip
    evil = pickle.dumps(_Evil(marker), protocol=2)
    async with running_collector(cfg) as col:
        src = col.scheduler["w"]
        await _push(endpoint, [evil, _kv_metrics_pickle()])
        reason = "pickle_forbidden" if allow_pickle else "pickle_refused"
        want = {("kv_metrics", reason): 2 - allow_pickle}
        await until_async(
            lambda: src.errors() == want and (not allow_pickle or src.values()),
            10, f"the pickles counted as {want}", src.errors,
        )  # fmt: skip
        assert not marker.exists(), "the pickle ran code"
        snap = await col.snapshot()
        # what was refused reaches the operator: kvobserve_scheduler_source_errors_total
        assert [(e.worker_id, e.source, e.reason, e.count) for e in snap.scheduler_errors] == [
            ("w", "kv_metrics", reason, 2 - allow_pickle)
        ]
        if allow_pickle:  # the real KvMetrics loads, into a stand-in, as numbers
            (sch,) = snap.scheduler
            got = (sch.source, sch.running_requests, sch.queued_requests, sch.max_total_tokens)
            assert got == ("kv_metrics", 3, 2, 4096)
        else:
            assert snap.scheduler == [] and src.values() == {}


# --- NATS: user/password and mutual TLS, collector to aggregator, as processes ------------------


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.stop_all()


def _gone(procs: Procs, pid: int) -> bool:
    return not procs.alive(pid)


def test_collect_and_aggregate_over_mutual_tls_with_a_password(
    tmp_path: Path, nats_server_factory: Callable[..., NatsServer], procs: Procs, sims: Sims
) -> None:
    pki = _make_pki(tmp_path)
    srv = nats_server_factory(
        ["--user", "kv", "--pass", "s3cret", "--tlsverify", "--tlscert", pki["server.pem"],
         "--tlskey", pki["server.key"], "--tlscacert", pki["ca.pem"]]
    )  # fmt: skip
    url = f"tls://127.0.0.1:{srv.port}"
    tls = {"tls_ca": pki["ca.pem"], "tls_cert": pki["client.pem"], "tls_key": pki["client.key"]}
    sim = engine(sims)
    cfg = collector_toml(tmp_path, sim, url, user="kv", password="s3cret", **tls)
    procs.kvobserve("collect", "collect", "-c", str(cfg))
    flags = [f"--nats-tls-{k[4:]}={v}" for k, v in tls.items()]
    secrets = clean_env(KVOBSERVE_NATS_USER="kv", KVOBSERVE_NATS_PASSWORD="s3cret")
    _, agg = aggregate(procs, "aggregate", url, *flags, env=secrets)
    collected(procs, agg, sim)  # every batch, exactly, through the TLS server
    # the same aggregator without its client certificate, or with a wrong password: exit 1
    for name, extra, env in (
        ("no-cert", [f"--nats-tls-ca={pki['ca.pem']}"], secrets),
        ("bad-pass", flags, clean_env(KVOBSERVE_NATS_USER="kv", KVOBSERVE_NATS_PASSWORD="no")),
    ):
        pid, _ = aggregate(procs, name, url, *extra, "--nats-connect-timeout", "2", env=env)
        log = partial(procs.log, pid)
        until(partial(_gone, procs, pid), 15, f"{name} exits", log)
        assert procs.terminate(pid)[0] == 1, log()  # already gone: its exit code
        assert f"kvobserve aggregate: error: nats {url}" in log()
