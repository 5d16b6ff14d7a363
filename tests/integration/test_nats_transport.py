"""NatsTransport against a real nats-server: subjects, reconnects, JetStream KV warm start, auth."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
import pytest

from kvobserve.aggregator import Aggregator
from kvobserve.analysis.conditions import active
from kvobserve.analysis.fleet import FleetState
from kvobserve.simulate.ports import free_port
from kvobserve.transport import TransportStatus
from kvobserve.transport.nats import NatsConnectError, NatsTransport
from kvobserve.transport.subjects import kv_bucket
from kvobserve.wire.snapshot import encode_snapshot
from tests.integration.conftest import NatsServer, make_snapshot
from tests.polling import until_async

pytestmark = pytest.mark.integration

Factory = Callable[..., Awaitable[NatsTransport]]


@pytest.fixture
async def transports() -> AsyncIterator[Factory]:
    """`await make(url, **kw)` returns a connected NatsTransport; all are closed at the end."""
    made: list[NatsTransport] = []

    async def make(url: str, cluster: str = "test", **kw: Any) -> NatsTransport:
        kw.setdefault("reconnect_wait_s", 0.05)
        kw.setdefault("reconnect_max_wait_s", 0.2)
        t = NatsTransport(url, cluster, **kw)
        made.append(t)
        await t.connect()
        return t

    try:
        yield make
    finally:
        for t in made:
            await t.close()


async def test_two_collectors_arrive_on_exact_subjects(
    nats_server: NatsServer, transports: Factory
) -> None:
    seen: list[str] = []
    spy = await nats.connect(nats_server.url)

    async def record(msg: Any) -> None:
        seen.append(msg.subject)

    await spy.subscribe("kvobserve.>", cb=record)
    await spy.flush()
    agg_t = await transports(nats_server.url, "prod-a")
    agg = Aggregator(FleetState())
    await agg.start(agg_t)
    c0 = await transports(nats_server.url, "prod-a")
    c1 = await transports(nats_server.url, "prod-a")
    # "gpu.node 1*" is not a valid subject token: dots, spaces and wildcards are replaced.
    await c0.publish_snapshot("node-0", encode_snapshot(make_snapshot("node-0", dp_size=2)))
    await c1.publish_snapshot(
        "gpu.node 1*",
        encode_snapshot(make_snapshot("gpu.node 1*", dp_size=2, ranks=(1,), node_rank=1)),
    )
    await until_async(lambda: len(agg.view().collectors) == 2, 10.0, "both collectors in the view")
    await until_async(lambda: len(seen) == 2, 10.0, "spy saw both")
    try:
        view = agg.view()
        assert [c.info.collector_id for c in view.collectors] == ["gpu.node 1*", "node-0"]
        assert all(c.up for c in view.collectors)
        assert view.owners[("w0", 0)] == ["node-0"] and view.owners[("w0", 1)] == ["gpu.node 1*"]
        assert active(view) == []
        assert sorted(seen) == [
            "kvobserve.v1.prod-a.snapshot.gpu_node_1_",
            "kvobserve.v1.prod-a.snapshot.node-0",
        ]
        assert agg_t.counters.received == 2 and c0.counters.published == 1
        assert agg.snapshots_applied == 2 and agg.decode_errors == {}
    finally:
        await spy.close()


async def test_other_cluster_is_not_received(nats_server: NatsServer, transports: Factory) -> None:
    agg_t = await transports(nats_server.url, "a")
    got: list[bytes] = []
    await agg_t.subscribe_snapshots(got.append)
    other = await transports(nats_server.url, "b")
    same = await transports(nats_server.url, "a")
    await other.publish_snapshot("x", b"from-b")
    await same.publish_snapshot("x", b"from-a")
    await until_async(lambda: got == [b"from-a"], 10.0, "only cluster a's message")
    # A message of cluster b would have been delivered before a's (one connection, in order).
    assert agg_t.counters.received == 1


async def test_server_restart_converges(nats_server: NatsServer, transports: Factory) -> None:
    agg_t = await transports(nats_server.url)
    agg = Aggregator(FleetState())
    await agg.start(agg_t)
    col = await transports(nats_server.url)
    final_seq = 60

    async def collector() -> None:
        for seq in range(final_seq + 1):
            snap = make_snapshot("node-0", seq, batches=10 * seq)
            await col.publish_snapshot("node-0", encode_snapshot(snap))
            await asyncio.sleep(0.02)  # the collector's interval, not synchronization

    publishing = asyncio.create_task(collector())
    await until_async(lambda: agg.snapshots_applied >= 5, 10.0, "first snapshots applied")
    await asyncio.to_thread(nats_server.restart)  # the loop keeps publishing meanwhile
    await publishing

    def final_count() -> int | None:
        streams = agg.view().streams
        return streams[0].stats.batches_total if streams else None

    # Snapshots sent while the server was down were buffered or lost; the cumulative final one,
    # sent long after the reconnect, is what the view must show.
    await until_async(lambda: final_count() == 10 * final_seq, 10.0, "final cumulative count")
    assert col.counters.reconnects >= 1 and agg_t.counters.reconnects >= 1
    assert col.status is TransportStatus.CONNECTED and agg_t.status is TransportStatus.CONNECTED
    assert agg.snapshots_ignored == 0  # snapshots never went backwards


async def test_jetstream_kv_warm_start(nats_server: NatsServer, transports: Factory) -> None:
    col = await transports(nats_server.url, "prod-a", jetstream_kv=True, kv_ttl_s=120)
    await col.publish_snapshot("node-0", encode_snapshot(make_snapshot("node-0", 7, batches=70)))
    await col.publish_snapshot("node-1", encode_snapshot(make_snapshot("node-1", 3, ranks=(1,))))
    js = await nats.connect(nats_server.url)
    try:
        kv = await js.jetstream().key_value("kvobserve_snapshots_prod-a")
        status = await kv.status()
        assert status.history == 1 and status.ttl == 120

        async def stored() -> set[str]:
            try:
                return set(await kv.keys())
            except nats.js.errors.NoKeysError:
                return set()

        async def both() -> set[str] | None:
            keys = await stored()
            return keys if keys == {"node-0", "node-1"} else None

        await until_async(both, 10, "both snapshots in the KV bucket", stored)
    finally:
        await js.close()
    # A fresh aggregator, started after the collectors fell silent, is warm at once.
    agg_t = await transports(nats_server.url, "prod-a", jetstream_kv=True)
    agg = Aggregator(FleetState())
    await agg.start(agg_t)
    view = agg.view()
    assert [c.info.collector_id for c in view.collectors] == ["node-0", "node-1"]
    assert all(c.up and c.age_s < 5 for c in view.collectors)
    by_id = {s.collector.collector_id: s.stats for s in view.streams}
    assert by_id["node-0"].batches_total == 70
    assert agg_t.counters.received == 0  # nothing arrived live: the view came from the bucket
    assert kv_bucket("prod-a") == "kvobserve_snapshots_prod-a"


async def test_jetstream_kv_without_jetstream_is_a_clear_error(
    nats_server_factory: Callable[..., NatsServer], transports: Factory
) -> None:
    srv = nats_server_factory(jetstream=False)
    with pytest.raises(NatsConnectError, match="JetStream"):
        await transports(srv.url, jetstream_kv=True, connect_timeout_s=1.0)


@pytest.mark.parametrize(
    ("server_args", "good", "bad"),
    [
        (["--user", "kv", "--pass", "s3cret"], {"user": "kv", "password": "s3cret"},
         {"user": "kv", "password": "wrong"}),
        (["--auth", "tok-123"], {"token": "tok-123"}, {"token": "tok-999"}),
    ],
    ids=["user-password", "token"],
)  # fmt: skip
async def test_auth(
    nats_server_factory: Callable[..., NatsServer],
    transports: Factory,
    server_args: list[str],
    good: dict[str, str],
    bad: dict[str, str],
) -> None:
    srv = nats_server_factory(server_args)
    sub = await transports(srv.url, **good)
    got: list[bytes] = []
    await sub.subscribe_snapshots(got.append)
    pub = await transports(srv.url, **good)
    await pub.publish_snapshot("n", b"hello")
    await until_async(lambda: got == [b"hello"], 10.0, "message through an authenticated server")

    t0 = time.monotonic()
    with pytest.raises(NatsConnectError, match="authorization failed"):
        await transports(srv.url, connect_timeout_s=3.0, **bad)
    assert time.monotonic() - t0 < 3.0  # fails on the server's answer, not at the timeout
    with pytest.raises(NatsConnectError, match="authorization failed"):
        await transports(srv.url, connect_timeout_s=3.0)  # no credentials at all


async def test_unreachable_server_fails_within_the_connect_timeout(transports: Factory) -> None:
    t0 = time.monotonic()
    with pytest.raises(NatsConnectError, match=r"127\.0\.0\.1"):
        await transports(f"nats://127.0.0.1:{free_port()}", connect_timeout_s=0.5)
    assert time.monotonic() - t0 < 2.0


async def test_publish_while_closed_is_counted_not_raised(
    nats_server: NatsServer, transports: Factory
) -> None:
    col = await transports(nats_server.url)
    await col.close()
    await col.close()  # idempotent
    await col.publish_snapshot("n", b"x")
    assert col.counters.dropped == {"closed": 1} and col.counters.published == 0
    assert col.status is TransportStatus.CLOSED


def _make_pki(d: Path) -> dict[str, str]:
    """A throwaway CA, a server cert for 127.0.0.1 and a client cert, with the openssl CLI."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=30)

    run(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=kvobserve-test-ca",
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", "san.ext")  # fmt: skip
    return {
        k: str(d / k) for k in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")
    }


async def test_mutual_tls(
    tmp_path: Path, nats_server_factory: Callable[..., NatsServer], transports: Factory
) -> None:
    pki = _make_pki(tmp_path)
    srv = nats_server_factory(
        ["--tlsverify", "--tlscert", pki["server.pem"], "--tlskey", pki["server.key"],
         "--tlscacert", pki["ca.pem"]]
    )  # fmt: skip
    tls = {"tls_ca": pki["ca.pem"], "tls_cert": pki["client.pem"], "tls_key": pki["client.key"]}
    url = f"tls://127.0.0.1:{srv.port}"
    sub = await transports(url, **tls)
    got: list[bytes] = []
    await sub.subscribe_snapshots(got.append)
    pub = await transports(url, **tls)
    await pub.publish_snapshot("n", b"over-tls")
    await until_async(lambda: got == [b"over-tls"], 10.0, "message over mutual TLS")

    t0 = time.monotonic()
    with pytest.raises(NatsConnectError, match="nats tls://127"):
        await transports(url, tls_ca=pki["ca.pem"], connect_timeout_s=1.0)  # no client cert
    assert time.monotonic() - t0 < 3.0
    with pytest.raises(NatsConnectError, match=r"tls_ca '/nonexistent/ca\.pem'"):
        await transports(url, tls_ca="/nonexistent/ca.pem")
