"""Acceptance (issue 24 a): vLLM publishers that connect, received on endpoints the collector binds.

The simulator in connect mode stands in for vLLM given a concrete endpoint (`tcp://collector:5557`:
its PUB connects, rank r to port + r), from its own loopback address, where its replay ROUTER
binds; so a replay asked of the wrong host fails instead of passing by accident.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import zmq

from kvobserve.collector import Collector
from kvobserve.config import Config
from kvobserve.simulate import FaultConfig, SimulatedWorker
from kvobserve.simulate.ports import free_port_range
from kvobserve.sources.ingest_options import IngestOptions
from kvobserve.wire.snapshot import BindStats, Snapshot
from tests.integration.collector_helpers import (
    Sims,
    all_streams,
    collector_config,
    resident,
    running_collector,
    sim_config,
    stream,
    truth_instance,
    truth_resident,
    wait_snapshot,
)

pytestmark = pytest.mark.integration
ENGINE_HOST = "127.0.0.2"  # the engine's node: its replay ROUTERs bind here only
DROPPED = frozenset({10, 11, 12, 50})


def _bind_config(port: int, dp_size: int, replay: str | None = None, **worker: Any) -> Config:
    return collector_config(
        "vllm", bind=f"tcp://127.0.0.1:{port}", dp_size=dp_size, replay_endpoint=replay, **worker
    )


def _connecting(port: int, **kw: Any) -> Any:
    kw.setdefault("start_delay_s", 1.5)  # the collector binds and takes the connections first
    kw.setdefault("host", ENGINE_HOST)
    return sim_config("vllm-0.33", kv_connect=f"tcp://127.0.0.1:{port}", **kw)


def _bind(snap: Snapshot, rank: int) -> BindStats:
    return next(b for b in snap.binds if b.dp_rank == rank)


async def _wait_publishers(col: Collector, n: int, *sims: SimulatedWorker) -> Snapshot:
    """Every bound endpoint has `n` connections, before the engines publish (none is missed)."""
    snap = await wait_snapshot(
        col,
        lambda s: bool(s.binds) and all(b.publishers == n for b in s.binds),
        what=f"{n} publisher(s) connected to every bound endpoint",
    )
    for sim in sims:
        left = sim.started_at + sim.cfg.start_delay_s - time.monotonic()
        assert left > 0, f"slow joiner: connected {-left:.2f} s after publishing began"
    return snap


async def test_connecting_vllm_publishers_give_exact_blocks_and_gaps_recovered_by_replay(
    sims: Sims,
) -> None:
    port = free_port_range("127.0.0.1", 2)
    sim = sims.start(_connecting(port, max_batches=200, faults=FaultConfig(drop_seqs=DROPPED)))
    replay = f"tcp://{ENGINE_HOST}:{sim.replay_base}"
    async with running_collector(_bind_config(port, 2, replay)) as col:
        snap = await _wait_publishers(col, 1, sim)
        assert [(b.endpoint, b.state) for b in snap.binds] == [
            (f"tcp://127.0.0.1:{port + r}", "connected") for r in (0, 1)
        ]
        assert [(s.state, s.up) for s in snap.streams] == [("waiting", True)] * 2
        snap = await wait_snapshot(
            col,
            all_streams(lambda s: s.batches_total == 200 and s.missed == 4 and not s.replaying),
            what="every batch applied, replays done",
        )
        truth = sim.truth()
        for r in (0, 1):
            inst = truth_instance(truth, r)
            assert set(inst["live_dropped_seqs"]) == DROPPED
            st = stream(snap, r)
            assert (st.worker_id, st.endpoint, st.state) == (
                "w",
                f"tcp://127.0.0.1:{port + r}",
                "up",
            )
            assert (st.gaps, st.missed, st.recovered, st.lost) == (2, 4, 4, 0)
            # one replay per gap; on a loaded machine the second gap can be seen while the first
            # replay is being asked for, and one replay recovers both
            assert st.replay_requests in ({"ok": 2}, {"ok": 1})
            assert st.state_complete is True and st.rank_mismatch_batches == 0
            assert await resident(col, "w", r) == truth_resident(inst)
            b = _bind(snap, r)
            assert (b.messages_total, b.skipped, b.streams) == (200 - len(DROPPED), {}, 1)
        assert [(w.worker_id, w.dp_size, w.ranks_owned) for w in snap.workers] == [("w", 2, [0, 1])]
        sim.stop()
        snap = await wait_snapshot(
            col, all_streams(lambda s: s.state == "listening"), what="publishers gone"
        )
        assert stream(snap, 0).reason == (
            "the publisher disconnected (engine stopped?); "
            f"listening on tcp://127.0.0.1:{port}, no publisher connected"
        )
        assert [b.publishers for b in snap.binds] == [0, 0]


async def test_a_publisher_that_reconnects_from_seq_0_is_a_restart(sims: Sims) -> None:
    port = free_port_range("127.0.0.1", 1)
    old = sims.start(_connecting(port, dp_size=1, max_batches=40))
    async with running_collector(_bind_config(port, 1)) as col:
        await _wait_publishers(col, 1, old)
        await wait_snapshot(col, all_streams(lambda s: s.batches_total == 40), what="first")
        old.stop()
        await wait_snapshot(col, lambda s: _bind(s, 0).publishers == 0, what="disconnected")
        # a new engine process: another seed, so blocks kept from the old one would not match
        new = sims.start(dataclasses.replace(old.cfg, seed=7, max_batches=30))
        await _wait_publishers(col, 1, new)
        snap = await wait_snapshot(
            col, all_streams(lambda s: s.batches_total == 70), what="second instance applied"
        )
        st = stream(snap, 0)
        assert (st.restarts, st.gaps, st.missed, st.lost, st.duplicate_stream) == (
            1,
            0,
            0,
            0,
            False,
        )
        assert await resident(col, "w", 0) == truth_resident(truth_instance(new.truth(), 0))


async def test_two_engines_connected_to_one_rank_port_are_a_duplicate_stream(sims: Sims) -> None:
    port = free_port_range("127.0.0.1", 1)
    one = sims.start(_connecting(port, dp_size=1, rate=100.0, max_batches=0))
    two = sims.start(dataclasses.replace(one.cfg, worker_id="other", host="127.0.0.3", seed=3))
    async with running_collector(_bind_config(port, 1)) as col:
        await _wait_publishers(col, 2, one, two)
        snap = await wait_snapshot(
            col,
            lambda s: stream(s, 0).duplicate_stream and stream(s, 0).state == "duplicate",
            timeout_s=10.0,
            what="duplicate stream",
        )
        assert stream(snap, 0).restarts == 0
        assert _bind(snap, 0).reason == f"2 publisher(s) connected to tcp://127.0.0.1:{port}"


async def test_an_endpoint_in_use_is_reported_and_bound_once_free(sims: Sims) -> None:
    port = free_port_range("127.0.0.1", 1)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    squatter = ctx.socket(zmq.PULL)
    squatter.bind(f"tcp://127.0.0.1:{port}")
    try:
        options = IngestOptions(rebind_s=0.5)
        async with running_collector(_bind_config(port, 1), ingest=options) as col:
            snap = await wait_snapshot(
                col, lambda s: _bind(s, 0).state == "bind_failed", what="bind failed"
            )
            assert _bind(snap, 0).reason == (
                f"cannot bind tcp://127.0.0.1:{port}: Address already in use (another process "
                "binds that port: a second kvobserve, or the scheduler, which cannot share it; "
                "relay_to puts kvobserve in front of it); trying again every 0.5 s"
            )
            assert (stream(snap, 0).state, stream(snap, 0).up) == ("bind_failed", False)
            squatter.close(linger=0)
            sim = sims.start(_connecting(port, dp_size=1, max_batches=20, start_delay_s=3.0))
            await _wait_publishers(col, 1, sim)
            snap = await wait_snapshot(
                col, all_streams(lambda s: s.batches_total == 20), what="batches"
            )
            assert await resident(col, "w", 0) == truth_resident(truth_instance(sim.truth(), 0))
    finally:
        ctx.destroy(linger=0)


async def test_messages_under_another_topic_are_counted_and_named(sims: Sims) -> None:
    port = free_port_range("127.0.0.1", 1)
    sim = sims.start(_connecting(port, dp_size=1, max_batches=30, topic="other"))
    async with running_collector(_bind_config(port, 1, topic="kv")) as col:
        await _wait_publishers(col, 1, sim)
        snap = await wait_snapshot(
            col,
            lambda s: (
                _bind(s, 0).skipped.get("topic_mismatch") == 30
                and stream(s, 0).state == "wrong_topic"
            ),
            what="mismatches counted",
        )
        b = _bind(snap, 0)
        assert b.skip_reason == "topic 'other' is not under 'kv'"
        assert stream(snap, 0).reason == "topic mismatch: subscribed 'kv', saw 'other'"
        assert stream(snap, 0).batches_total == 0


async def test_pods_past_the_stream_cap_are_refused_and_let_in_when_one_is_forgotten(
    sims: Sims,
) -> None:
    port = free_port_range("127.0.0.1", 1)
    pods = [
        sims.start(
            _connecting(port, dp_size=1, rate=50.0, max_batches=0, worker_id=f"pod-{i}",
                        host=ip, topic=f"kv@{ip}:8000@m", seed=i, replay_port=None)
        )
        for i, ip in enumerate(("127.0.0.2", "127.0.0.3", "127.0.0.4"))
    ]  # fmt: skip
    options = IngestOptions(max_streams=2, forget_after_s=1.0)
    cfg = _bind_config(port, 1, worker_id="llmd", topic="kv@{pod}@{model}")
    async with running_collector(cfg, ingest=options) as col:
        await _wait_publishers(col, 3, *pods)
        snap = await wait_snapshot(
            col,
            lambda s: len(s.streams) == 2 and _bind(s, 0).skipped.get("refused", 0) >= 10,
            what="two pods taken, the third refused",
        )
        taken = {s.worker_id for s in snap.streams}
        (late,) = {f"llmd/{ip}:8000" for ip in ("127.0.0.2", "127.0.0.3", "127.0.0.4")} - taken
        assert snap.refused == {"streams": 1}  # kvobserve_collector_refused_total{what="streams"}
        assert sorted(w.worker_id for w in snap.workers) == sorted(taken)
        assert _bind(snap, 0).skip_reason == f"{late}: past max_streams"
        # one taken pod stops: forgotten after forget_after_s, the refused one gets its place
        gone = next(p for p in pods if f"llmd/{p.cfg.host}:8000" in taken)
        gone.stop()
        snap = await wait_snapshot(
            col,
            lambda s: (
                {x.worker_id for x in s.streams} == taken - {f"llmd/{gone.cfg.host}:8000"} | {late}
            ),
            what="the stopped pod forgotten, the refused one streaming",
        )
        assert snap.refused == {"streams": 1}  # counted once per pod, not per message
        assert sorted(w.worker_id for w in snap.workers) == sorted(
            s.worker_id for s in snap.streams
        )
