"""The aggregator over a real nats-server: condition events, and `kvobserve aggregate` as a process."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvobserve.aggregator import Aggregator
from kvobserve.analysis.conditions import DOWN_AFTER_S
from kvobserve.analysis.fleet import FleetState
from kvobserve.cli import main
from kvobserve.simulate.ports import free_port
from kvobserve.transport.nats import NatsTransport
from kvobserve.wire.snapshot import encode_snapshot
from tests.integration.conftest import NatsServer, make_snapshot
from tests.polling import until_async

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def pair(nats_server: NatsServer) -> AsyncIterator[tuple[NatsTransport, NatsTransport]]:
    """A collector-side and an observer-side transport on cluster `c1`."""
    col = NatsTransport(nats_server.url, "c1")
    obs = NatsTransport(nats_server.url, "c1")
    await col.connect()
    await obs.connect()
    try:
        yield col, obs
    finally:
        await col.close()
        await obs.close()


async def test_collector_going_silent_fires_then_resolves(
    nats_server: NatsServer, pair: tuple[NatsTransport, NatsTransport]
) -> None:
    col, obs = pair
    events: list[dict[str, Any]] = []
    subjects: list[str] = []
    await obs.subscribe_events(lambda data: events.append(json.loads(data)))
    assert obs.client is not None

    async def spy(msg: Any) -> None:
        subjects.append(msg.subject)

    await obs.client.subscribe("kvobserve.v1.c1.event.>", cb=spy)
    agg_t = NatsTransport(nats_server.url, "c1")
    await agg_t.connect()
    agg = Aggregator(FleetState(), interval_s=0.05)
    try:
        await agg.start(agg_t)
        # interval 0.1 s: silent for 3 intervals (0.3 s) means down.
        await col.publish_snapshot(
            "node-0", encode_snapshot(make_snapshot("node-0", 0, interval_s=0.1))
        )
        await until_async(lambda: bool(agg.view().collectors), 10.0, "snapshot applied")
        await until_async(
            lambda: any(e["kind"] == "collector_down" for e in events), 10.0, "firing"
        )
        down = next(e for e in events if e["kind"] == "collector_down")
        assert down["state"] == "firing" and down["severity"] == "critical"
        assert down["labels"] == {"collector": "node-0", "node_rank": "0"}
        assert "node-0" in down["description"] and down["time"] > 0
        assert "kvobserve.v1.c1.event.collector_down" in subjects

        # back, now with a long interval so it cannot go down again before the count below
        await col.publish_snapshot(
            "node-0", encode_snapshot(make_snapshot("node-0", 1, interval_s=60.0))
        )
        await until_async(
            lambda: any(e["kind"] == "collector_down" and e["state"] == "resolved" for e in events),
            10.0,
            "resolved",
        )
        # Transitions only: one firing per outage, never one per tick.
        await until_async(
            lambda: agg.transitions_total.get("resolved", 0) >= 1, 10.0, "one resolved transition"
        )
        firing = [e for e in events if e["kind"] == "collector_down" and e["state"] == "firing"]
        assert len(firing) == 1
    finally:
        await agg.stop()
        await agg_t.close()


def _spawn(args: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(extra_env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "kvobserve", "aggregate", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


async def test_aggregate_process_serves_and_stops_on_sigterm(
    nats_server: NatsServer, pair: tuple[NatsTransport, NatsTransport]
) -> None:
    col, obs = pair
    events: list[dict[str, Any]] = []
    await obs.subscribe_events(lambda data: events.append(json.loads(data)))
    port = free_port()
    proc = _spawn(["--nats", nats_server.url, "--cluster", "c1", "--listen", f"127.0.0.1:{port}"])
    try:
        # Worker w0 has 2 ranks, this collector owns only rank 0: the process must say so.
        snap = make_snapshot("node-0", 0, dp_size=2, ranks=(0,), interval_s=60)
        seq = 0

        def announced() -> bool:
            return any(e["kind"] == "dp_rank_uncovered" for e in events)

        # includes the child's interpreter start-up, and the DOWN_AFTER_S a rank that no
        # collector ever owned waits before it counts as uncovered
        end = time.monotonic() + 15 + DOWN_AFTER_S
        while not announced():
            assert proc.poll() is None, f"aggregate exited early: {proc.communicate()[1]}"
            assert time.monotonic() < end, "no dp_rank_uncovered event from the process"
            seq += 1  # until it has subscribed, snapshots go nowhere; the collector repeats
            snap.seq = seq
            await col.publish_snapshot("node-0", encode_snapshot(snap))
            await asyncio.sleep(0.05)  # the fake collector's interval
        ev = next(e for e in events if e["kind"] == "dp_rank_uncovered")
        assert ev["state"] == "firing" and ev["labels"] == {"worker_id": "w0", "dp_rank": "1"}
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            async with http.get(f"{base}/healthz") as r:
                assert r.status == 200
            async with http.get(f"{base}/readyz") as r:
                assert r.status == 200  # a collector snapshot has been applied
            async with http.get(f"{base}/metrics") as r:
                body = await r.text()
        assert 'kvobserve_collector_up{collector="node-0"' in body
        assert "kvobserve_aggregator_snapshots_applied_total " in body
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=5)
        elapsed = time.monotonic() - t0
        stderr = proc.stderr.read() if proc.stderr else ""
        assert rc == 0, stderr
        assert elapsed < 2.0, f"took {elapsed:.2f} s to stop"
        assert "condition firing: dp_rank_uncovered worker_id=w0 dp_rank=1" in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        if proc.stderr:
            proc.stderr.close()


@pytest.mark.parametrize(
    ("args", "flag", "value"),
    [
        (["--nats", "http://127.0.0.1:4222"], "--nats", "'http://127.0.0.1:4222'"),
        (["--nats", "127.0.0.1:4222"], "--nats", "'127.0.0.1:4222'"),
        (["--nats", "nats://h:4222", "--listen", "localhost"], "--listen", "'localhost'"),
        (["--nats", "nats://h:4222", "--listen", "h:99999"], "--listen", "'h:99999'"),
        (["--nats", "nats://h:4222", "--cluster", "a.b"], "--cluster", "'a.b'"),
        (["--nats", "nats://h:4222", "--stale-intervals", "0"], "--stale-intervals", "0.0"),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], flag: str, value: str
) -> None:
    rc = main(["aggregate", *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("kvobserve aggregate: error: ")
    assert flag in err and value in err


def test_unreachable_nats_exits_1() -> None:
    proc = _spawn(["--nats", f"nats://127.0.0.1:{free_port()}", "--nats-connect-timeout", "0.5"])
    try:
        _, stderr = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
    assert proc.returncode == 1
    assert "kvobserve aggregate: error: nats nats://127.0.0.1:" in stderr


async def test_aggregate_serves_https_with_basic_auth(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    from tests.certs import self_signed

    cert, key = self_signed(tmp_path)
    port = free_port()
    proc = _spawn(
        ["--nats", nats_server.url, "--listen", f"127.0.0.1:{port}",
         "--http-user", "ops", "--tls-cert", cert, "--tls-key", key],
        {"KVOBSERVE_HTTP_PASSWORD": "s3cret"},  # a secret from the environment, not from `ps`
    )  # fmt: skip
    client = ssl.create_default_context(cafile=cert)
    url = f"https://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            end = time.monotonic() + 15
            while True:
                assert proc.poll() is None, proc.communicate()[1]
                try:
                    async with http.get(f"{url}/healthz", ssl=client) as r:
                        assert r.status == 200  # health needs no credentials
                        break
                except aiohttp.ClientConnectionError:
                    assert time.monotonic() < end, "aggregate did not serve HTTPS"
                    await asyncio.sleep(0.1)
            async with http.get(f"{url}/metrics", ssl=client) as r:
                assert r.status == 401
            auth = {"Authorization": "Basic " + base64.b64encode(b"ops:s3cret").decode()}
            async with http.get(f"{url}/metrics", ssl=client, headers=auth) as r:
                assert r.status == 200 and "kvobserve_build_info" in await r.text()
    finally:
        proc.terminate()
        proc.wait(timeout=5)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--http-user", "ops"], "http.password: missing (--http-user (http.user) is set)"),
        (["--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.key"], "--tls-cert"),
    ],
)
def test_bad_http_security_flags_exit_2_naming_them(flags: list[str], named: str) -> None:
    proc = _spawn(["--nats", "nats://127.0.0.1:4222", *flags])
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert named in err and len(err.strip().splitlines()) == 1
