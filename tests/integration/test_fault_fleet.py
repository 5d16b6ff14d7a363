"""Fault matrix, fleet side: aggregator restart (warm from JetStream KV), a collector killed and
restarted, a slow aggregator, a corrupt snapshot. Exact counters; nothing collected is lost."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvobserve.aggregator import Aggregator
from kvobserve.analysis.fleet import FleetState
from kvobserve.simulate import SimulatedWorker
from kvobserve.simulate.ports import free_port, free_port_range
from kvobserve.transport.local import LocalBus
from kvobserve.transport.nats import NatsTransport
from kvobserve.wire.snapshot import encode_snapshot
from tests.integration.collector_helpers import Sims, sim_config, truth_instance
from tests.integration.conftest import NatsServer, make_snapshot
from tests.integration.fleet_helpers import Procs, Scrape, scrape, write_toml
from tests.polling import until, until_async

pytestmark = pytest.mark.integration

CLUSTER = "faults"
KEYS = ("worker_id", "dp_rank")
Counts = dict[tuple[str, ...], float]


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.stop_all()


def engine(sims: Sims) -> SimulatedWorker:
    """A started engine, held before its first batch: `collected` lets it publish 60 batches per
    rank once the collector is connected."""
    kv, replay = free_port_range("127.0.0.1", 3), free_port_range("127.0.0.1", 2)
    cfg = sim_config("sglang-0.5.23", topic="kv-events", kv_port=kv, replay_port=replay)
    sim = sims.start(dataclasses.replace(cfg, start_delay_s=5.0))
    sim.pause()  # long before the start delay ends
    assert all(s.seq == 0 for st in sim.ranks for s in st.streams)
    return sim


def collector_toml(
    tmp_path: Path, sim: SimulatedWorker, nats: str, interval_s: float = 0.5, **extra: Any
) -> Path:
    """A `kvobserve collect` config watching both ranks of `sim`; `extra` goes into [nats]."""
    c = sim.cfg
    return write_toml(
        tmp_path / "node-0.toml",
        {
            "cluster": CLUSTER,
            "collector": {"id": "node-0", "interval_s": interval_s},
            "http": {"listen": f"127.0.0.1:{free_port()}"},
            "worker": [
                {
                    "id": "w",
                    "engine": "sglang",
                    "dp_size": 2,
                    "dp_attention": True,
                    "topic": "kv-events",
                    "kv_endpoint": f"tcp://127.0.0.1:{c.kv_port}",
                    "replay_endpoint": f"tcp://127.0.0.1:{c.replay_port}",
                },
            ],
            "nats": {"url": nats, **extra},
        },
    )


def aggregate(
    procs: Procs, name: str, nats: str, *extra: str, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """A `kvobserve aggregate` process; (pid, base URL)."""
    port = free_port()
    pid = procs.kvobserve(
        name, "aggregate", "--nats", nats, "--cluster", CLUSTER,
        "--listen", f"127.0.0.1:{port}", *extra, env=env,
    )  # fmt: skip
    return pid, f"http://127.0.0.1:{port}"


def _truth(
    sim: SimulatedWorker,
) -> tuple[dict[tuple[str, ...], float], dict[tuple[str, ...], float]]:
    """(batches per stream, resident blocks per stream and medium) from the engine."""
    t = sim.truth()
    batches: Counts = {("w", str(r)): float(truth_instance(t, r)["batches"]) for r in (0, 1)}
    blocks: Counts = {
        ("w", str(r), m): float(len(hs))
        for r in (0, 1)
        for m, hs in truth_instance(t, r)["resident"].items()
    }
    return batches, blocks


def _batches(s: Scrape | None) -> dict[tuple[str, ...], float]:
    return s.by("kvobserve_kv_event_batches_total", KEYS) if s else {}


def collected(procs: Procs, agg: str, sim: SimulatedWorker) -> Scrape:
    """The aggregator's view once all 60 batches of each rank were applied."""

    def connected() -> bool:
        s = scrape(agg)
        return s is not None and s.by("kvobserve_stream_up", KEYS) == {
            ("w", "0"): 1.0,
            ("w", "1"): 1.0,
        }

    logs = lambda: "\n".join(procs.log(p.pid) for p, _ in procs.started)  # noqa: E731
    until(connected, 20, "both streams up", logs)
    sim.resume()  # the engine's first batch goes to a connected collector
    until(lambda: all(s.seq >= 60 for st in sim.ranks for s in st.streams), 10, "engine done")
    want, _ = _truth(sim)

    def done() -> Scrape | None:
        s = scrape(agg)
        return s if _batches(s) == want else None

    return until(done, 20, "60 batches on each stream", lambda: scrape(agg))


def _kill(procs: Procs, pid: int) -> None:
    """SIGKILL by PID (a crash), and reap it."""
    os.kill(pid, signal.SIGKILL)
    until(lambda: not procs.alive(pid), 5, f"pid {pid} gone")


def test_a_restarted_aggregator_is_warm_from_jetstream_kv(
    nats_server: NatsServer, procs: Procs, sims: Sims, tmp_path: Path
) -> None:
    sim = engine(sims)
    # A snapshot read from the bucket is live for 3 intervals after the restart: 2 s intervals
    # keep the read fleet live long enough to be scraped whole on a loaded machine.
    cfg = collector_toml(tmp_path, sim, nats_server.url, interval_s=2.0, jetstream_kv=True)
    col = procs.kvobserve("collect", "collect", "-c", str(cfg))
    agg1, base1 = aggregate(procs, "aggregate-1", nats_server.url, "--jetstream-kv")
    collected(procs, base1, sim)
    batches, blocks = _truth(sim)
    # the collector leaves for good (no snapshot can arrive any more); the aggregator crashes
    assert procs.terminate(col)[0] == 0, procs.log(col)
    _kill(procs, agg1)
    _, base2 = aggregate(procs, "aggregate-2", nats_server.url, "--jetstream-kv")

    def warm() -> Scrape | None:
        s = scrape(base2)
        return s if _batches(s) else None

    s = until(warm, 20, "the fleet, read from the bucket")
    assert _batches(s) == batches  # shown at once, exact: read from the KV bucket
    assert s.by("kvobserve_kv_blocks", (*KEYS, "medium")) == blocks
    assert s.by("kvobserve_nats_snapshots_received_total", ()) == {(): 0.0}  # nothing live
    assert set(s.by("kvobserve_collector_up", ("collector",))) == {("node-0",)}


def test_a_killed_collector_restarts_from_zero_without_mixing(
    nats_server: NatsServer, procs: Procs, sims: Sims, tmp_path: Path
) -> None:
    sim = engine(sims)
    cfg = collector_toml(tmp_path, sim, nats_server.url)
    col = procs.kvobserve("collect-1", "collect", "-c", str(cfg))
    _, agg = aggregate(procs, "aggregate", nats_server.url)
    s = collected(procs, agg, sim)
    batches, _ = _truth(sim)
    (start1,) = s.by("kvobserve_collector_start_time_seconds", ("collector",)).values()

    def up() -> float | None:
        s = scrape(agg)
        return s.by("kvobserve_collector_up", ("collector",)).get(("node-0",)) if s else None

    _kill(procs, col)  # SIGKILL: no goodbye, the last snapshot just stops coming
    until(lambda: up() == 0.0, 3 * 0.5 + 3.0, "node-0 down", lambda: scrape(agg))
    s = until(lambda: scrape(agg), 5, "scrape")
    assert _batches(s) == batches  # what it collected is still shown, marked down
    assert s.by("kvobserve_stream_up", KEYS) == {("w", "0"): 0.0, ("w", "1"): 0.0}

    procs.kvobserve("collect-2", "collect", "-c", str(cfg))  # same id, a new process
    fresh = {("w", "0"): 0.0, ("w", "1"): 0.0}

    def restarted() -> Scrape | None:
        s = scrape(agg)
        if s is None or up() != 1.0:
            return None
        return (
            s if s.by("kvobserve_stream_up", KEYS) == {("w", "0"): 1.0, ("w", "1"): 1.0} else None
        )

    s = until(restarted, 20, "node-0 up again, connected", lambda: scrape(agg))
    # the engine is idle: the new process has applied nothing, and the aggregator says so
    assert _batches(s) == fresh, "the old process' counts must not carry over or add up"
    (start2,) = s.by("kvobserve_collector_start_time_seconds", ("collector",)).values()
    assert start2 > start1
    assert s.by("kvobserve_collector_up", ("collector",)) == {("node-0",): 1.0}


@pytest.fixture
async def nats_pair(nats_server: NatsServer) -> AsyncIterator[list[NatsTransport]]:
    made = [NatsTransport(nats_server.url, CLUSTER) for _ in range(4)]
    try:
        for t in made:
            await t.connect()
        yield made
    finally:
        for t in made:
            await t.close()


async def test_a_slow_aggregator_coalesces_per_collector_and_converges(
    nats_pair: list[NatsTransport],
) -> None:
    agg_t, *cols = nats_pair
    agg = Aggregator(FleetState())

    async def slow(data: bytes) -> None:  # 50 ms per snapshot: 20/s against 300/s published
        await asyncio.sleep(0.05)
        agg.on_snapshot(data)

    await agg_t.subscribe_snapshots(slow)
    n = 60
    for seq in range(1, n + 1):
        for i, c in enumerate(cols):
            snap = make_snapshot(f"node-{i}", seq, batches=10 * seq, cluster=CLUSTER)
            await c.publish_snapshot(f"node-{i}", encode_snapshot(snap))
        await asyncio.sleep(0.01)  # the collectors' interval, not synchronization

    def final() -> bool:
        return {s.collector.collector_id: s.stats.batches_total for s in agg.view().streams} == {
            f"node-{i}": 10 * n for i in range(3)
        }

    # it lags by at most one snapshot per collector (3 x 50 ms), not by a backlog of ~150
    await until_async(final, 1.5, "the final snapshot of every collector applied")
    counts = agg_t.counters
    await until_async(
        lambda: counts.received + counts.dropped.get("coalesced", 0) == 3 * n, 10.0, "all seen"
    )
    assert counts.dropped.get("coalesced", 0) > 0 and set(counts.dropped) == {"coalesced"}
    assert counts.handler_errors == 0
    assert agg.snapshots_applied == counts.received and agg.snapshots_ignored == 0


async def test_a_corrupt_snapshot_is_counted_and_the_next_one_applied() -> None:
    bus = LocalBus()
    agg = Aggregator(FleetState())
    await agg.start(bus)
    try:
        good = encode_snapshot(make_snapshot("node-0", 1, batches=5))
        # valid msgpack, a str of invalid UTF-8: msgspec raises UnicodeDecodeError
        bad = good.replace(b"node-0", b"node-\xff")
        assert bad != good
        await bus.publish_snapshot("node-0", bad)
        await bus.publish_snapshot("node-0", b"\xc1")
        assert agg.decode_errors == {"msgpack": 2}
        assert bus.counters.handler_errors == 0
        await bus.publish_snapshot("node-0", good)
        (sv,) = agg.view().streams
        assert sv.stats.batches_total == 5 and agg.snapshots_applied == 1
    finally:
        await agg.stop()
        await bus.close()
