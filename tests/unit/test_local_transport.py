"""The in-process bus, and the Aggregator driven through it with a fake clock."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import msgspec
import pytest

from benchmarks import scale
from kvobserve.aggregator import CHECK_SHARE, Aggregator
from kvobserve.analysis.fleet import FleetState
from kvobserve.transport import TransportStatus
from kvobserve.transport.local import LocalBus
from kvobserve.wire.snapshot import (
    CollectorInfo,
    Snapshot,
    StreamStats,
    WorkerInfo,
    encode_snapshot,
)


def snapshot(seq: int, batches: int = 0, cid: str = "node-0") -> bytes:
    """One collector owning rank 0 of w0, reporting every second."""
    return encode_snapshot(
        Snapshot(
            collector=CollectorInfo(cid, start_time=100.0),
            seq=seq,
            interval_s=1.0,
            workers=[WorkerInfo("w0", dp_size=1, ranks_owned=[0], leader=True)],
            streams=[StreamStats("w0", 0, up=True, batches_total=batches, state_complete=True)],
        )
    )


class Clock:
    """A settable wall clock."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


async def test_bus_delivers_to_sync_and_async_handlers_in_order() -> None:
    bus = LocalBus()
    sync_got: list[bytes] = []
    async_got: list[bytes] = []

    async def async_handler(data: bytes) -> None:
        async_got.append(data)

    await bus.subscribe_snapshots(sync_got.append)
    await bus.subscribe_snapshots(async_handler)
    for i in range(3):
        await bus.publish_snapshot("c", bytes([i]))
    assert sync_got == async_got == [b"\x00", b"\x01", b"\x02"]
    assert bus.counters.published == 3 and bus.counters.received == 6
    assert bus.status is TransportStatus.CONNECTED
    assert await bus.retained_snapshots() == []


async def test_a_failing_handler_is_counted_and_others_still_receive() -> None:
    bus = LocalBus()
    got: list[bytes] = []

    def broken(data: bytes) -> None:
        raise RuntimeError("boom")

    await bus.subscribe_snapshots(broken)
    await bus.subscribe_snapshots(got.append)
    await bus.publish_snapshot("c", b"a")
    await bus.publish_snapshot("c", b"b")
    assert got == [b"a", b"b"]
    assert bus.counters.handler_errors == 2 and bus.counters.received == 2


async def test_events_go_to_event_subscribers_only() -> None:
    bus = LocalBus()
    snaps: list[bytes] = []
    events: list[bytes] = []
    await bus.subscribe_snapshots(snaps.append)
    await bus.subscribe_events(events.append)
    await bus.publish_event("collector_down", b"{}")
    assert events == [b"{}"] and snaps == []


async def test_close_is_idempotent_and_later_publishes_are_dropped() -> None:
    bus = LocalBus()
    got: list[bytes] = []
    await bus.subscribe_snapshots(got.append)
    await bus.close()
    await bus.close()
    await bus.publish_snapshot("c", b"x")
    await bus.publish_event("k", b"y")
    assert got == [] and bus.counters.dropped == {"closed": 2}
    assert bus.status is TransportStatus.CLOSED


def test_local_path_does_not_import_nats() -> None:
    code = "import sys, kvobserve.transport.local, kvobserve.aggregator; print(sorted(m for m in sys.modules if m == 'nats' or m.startswith('nats.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


async def test_aggregator_counts_bad_snapshots_by_reason() -> None:
    bus = LocalBus()
    agg = Aggregator(FleetState(), clock=Clock())
    await agg.start(bus)
    try:
        await bus.publish_snapshot("c", b"\xc1")  # never valid msgpack
        await bus.publish_snapshot("c", msgspec.msgpack.encode({"collector": 5}))
        await bus.publish_snapshot("c", snapshot(1, batches=10))
        await bus.publish_snapshot("c", snapshot(0, batches=5))  # older: ignored
    finally:
        await agg.stop()
    assert agg.decode_errors == {"msgpack": 1, "schema": 1}
    assert agg.snapshots_received == 4
    assert (agg.snapshots_applied, agg.snapshots_ignored) == (1, 1)
    assert agg.view().streams[0].stats.batches_total == 10
    assert agg.stats()["decode_errors"] == {"msgpack": 1, "schema": 1}


async def test_transitions_are_published_once_per_change() -> None:
    clock = Clock()
    bus = LocalBus()
    events: list[dict[str, Any]] = []
    await bus.subscribe_events(lambda data: events.append(json.loads(data)))
    agg = Aggregator(FleetState(), clock=clock)
    await agg.start(bus)
    await agg.stop()  # ticks are driven by hand below
    await bus.publish_snapshot("node-0", snapshot(0))
    await agg.check_conditions()
    assert events == []
    clock.t += 3.5  # > 3 intervals of silence
    await agg.check_conditions()
    await agg.check_conditions()  # still down: nothing new
    firing = {(e["kind"], e["state"]) for e in events}
    assert firing == {
        ("collector_down", "firing"),
        ("stream_down", "firing"),
        ("dp_rank_uncovered", "firing"),
    }
    down = next(e for e in events if e["kind"] == "collector_down")
    assert down["labels"] == {"collector": "node-0", "node_rank": "0"}
    assert down["time"] == clock.t and down["severity"] == "critical"
    events.clear()
    await bus.publish_snapshot("node-0", snapshot(1))
    await agg.check_conditions()
    assert sorted((e["kind"], e["state"]) for e in events) == [
        ("collector_down", "resolved"),
        ("dp_rank_uncovered", "resolved"),
        ("stream_down", "resolved"),
    ]
    assert agg.transitions_total == {"firing": 3, "resolved": 3}


@pytest.mark.parametrize(("offset", "up"), [(-10.0, False), (-1.0, True), (+60.0, True)])
def test_received_time_of_retained_snapshots(offset: float, up: bool) -> None:
    clock = Clock()
    agg = Aggregator(FleetState(), clock=clock)
    agg.on_snapshot(snapshot(0), received=clock.t + offset)
    (c,) = agg.view().collectors
    assert c.up is up
    assert c.age_s == max(0.0, -offset)  # a stored time in the future is taken as now


async def test_a_big_fleet_is_checked_less_often_than_every_interval() -> None:
    agg = Aggregator(FleetState(), interval_s=1.0)
    await agg.check_conditions()  # an empty fleet: a check costs next to nothing
    assert agg.next_check_in() == 1.0
    now = time.time()
    for c in range(512):  # 4,096 streams, as benchmarks/scale.py's fleet
        agg.apply(scale.synthetic_snapshot(c, 8, 1, now))
    await agg.check_conditions()
    assert agg.check_cpu_s > 0
    assert agg.next_check_in() == max(1.0, CHECK_SHARE * agg.check_cpu_s)
