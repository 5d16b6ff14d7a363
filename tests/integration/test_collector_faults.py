"""Acceptance: publisher restarts, two publishers on one endpoint, wrong rank labels, stray and
mirrored publishers, each seen by a collector on real sockets."""

from __future__ import annotations

import dataclasses
import time

import pytest
import zmq

from kvobserve.analysis.conditions import active
from kvobserve.analysis.fleet import FleetState
from kvobserve.simulate import FaultConfig, SimConfig, SimulatedWorker
from kvobserve.wire.snapshot import Snapshot
from tests.integration.collector_helpers import (
    Sims,
    all_streams,
    resident,
    running_collector,
    sim_collector_config,
    sim_config,
    stream,
    truth_instance,
    truth_resident,
    wait_connected,
    wait_snapshot,
)
from tests.polling import until

pytestmark = pytest.mark.integration


def _restart_on_same_ports(sims: Sims, old: SimulatedWorker, cfg: SimConfig) -> SimulatedWorker:
    """A new engine process on the old one's ports (retried while the OS releases them)."""
    return until(
        lambda: sims.start(cfg), 5.0, "the old ports free again", retry_on=(OSError, zmq.ZMQError)
    )


async def test_publisher_restart_resets_the_stream(sims: Sims) -> None:
    old = sims.start(sim_config("sglang-0.5.23", max_batches=40), held=True)
    async with running_collector(sim_collector_config(old)) as col:
        await wait_connected(col, old)
        await wait_snapshot(
            col, all_streams(lambda s: s.batches_total == 40), what="first instance"
        )
        old.stop()
        await wait_snapshot(col, all_streams(lambda s: not s.up), what="streams down")
        # a different seed: a collector that kept the old blocks would not match the new truth
        new_cfg = dataclasses.replace(
            old.cfg,
            kv_port=old.kv_base,
            replay_port=old.replay_base,
            seed=7,
            max_batches=30,
            start_delay_s=1.0,  # the SUBs reconnect (with backoff) before it publishes
        )
        new = _restart_on_same_ports(sims, old, new_cfg)
        await wait_connected(col, new)
        snap = await wait_snapshot(
            col, all_streams(lambda s: s.batches_total == 70), what="second instance applied"
        )
        truth = new.truth()
        for r in (0, 1):
            st = stream(snap, r)
            assert (st.restarts, st.gaps, st.missed, st.lost) == (1, 0, 0, 0)
            assert st.duplicate_stream is False
            assert st.state_complete is True
            assert await resident(col, "w", r) == truth_resident(truth_instance(truth, r))


async def test_two_publishers_on_one_endpoint_are_a_duplicate_stream(sims: Sims) -> None:
    faults = FaultConfig(second_publisher=(1,))
    sim = sims.start(sim_config("vllm-0.33", rate=100.0, max_batches=0, faults=faults), held=True)
    async with running_collector(sim_collector_config(sim)) as col:
        await wait_connected(col, sim)
        t0 = time.monotonic()
        snap = await wait_snapshot(
            col, lambda s: stream(s, 1).duplicate_stream, timeout_s=5.0, what="duplicate stream"
        )
        assert time.monotonic() - t0 < 5.0
        assert stream(snap, 0).duplicate_stream is False
        assert stream(snap, 1).restarts == 0
        # the second publisher's batches are dropped and counted, the first's are applied
        snap = await wait_snapshot(
            col, lambda s: stream(s, 1).interleaved_batches >= 20, timeout_s=5.0, what="interleaved"
        )
        assert stream(snap, 0).interleaved_batches == 0
        assert snap.counters is not None
        received = snap.counters.messages_received
        applied = sum(s.batches_total + s.interleaved_batches for s in snap.streams)
        assert received >= applied > 0 and snap.counters.ingest_errors == 0


# rank 1 claims to be rank 5, or rank 0: the latter must not be taken for a mirror of rank 0
@pytest.mark.parametrize(("fmt", "label"), [("sglang-0.5.19", 5), ("vllm-0.33", 0)])
async def test_a_mislabelled_rank_counts_every_batch_as_mismatched(
    fmt: str, label: int, sims: Sims
) -> None:
    sim = sims.start(sim_config(fmt, faults=FaultConfig(wrong_rank=((1, label),))), held=True)
    async with running_collector(sim_collector_config(sim)) as col:
        await wait_connected(col, sim)
        snap = await wait_snapshot(
            col, all_streams(lambda s: s.batches_total == 60), what="batches"
        )
        truth = sim.truth()
        assert truth_instance(truth, 1)["rank_label"] == label
        assert stream(snap, 1).rank_mismatch_batches == truth_instance(truth, 1)["batches"] == 60
        assert stream(snap, 0).rank_mismatch_batches == 0
        assert [stream(snap, r).duplicate_stream for r in (0, 1)] == [False, False]
        for r in (0, 1):
            assert await resident(col, "w", r) == truth_resident(truth_instance(truth, r))


async def test_a_stray_publisher_on_the_probe_port_is_an_active_unexpected_stream(
    sims: Sims,
) -> None:
    sim = sims.start(sim_config("vllm-0.23", faults=FaultConfig(stray_publisher=True)), held=True)
    async with running_collector(sim_collector_config(sim)) as col:
        await wait_connected(col, sim)
        stray_ep = f"tcp://127.0.0.1:{sim.kv_base + 2}"
        snap = await wait_snapshot(
            col,
            lambda s: (
                [u.batches_total for u in s.unexpected] == [60]
                and all(x.batches_total == 60 for x in s.streams)
            ),
            what="stray batches counted",
        )
        (u,) = snap.unexpected
        assert (u.worker_id, u.dp_rank, u.endpoint, u.active) == ("w", 2, stray_ep, True)
        assert [stream(snap, r).duplicate_stream for r in (0, 1)] == [False, False]


async def test_a_mirrored_stream_is_a_duplicate_stream_on_both_ranks(sims: Sims) -> None:
    sim = sims.start(
        sim_config("sglang-0.5.23", dp_size=3, faults=FaultConfig(mirror=((0, 1),))), held=True
    )
    async with running_collector(sim_collector_config(sim)) as col:
        await wait_connected(col, sim)
        snap = await wait_snapshot(
            col,
            lambda s: stream(s, 0).batches_total == 60 and stream(s, 1).batches_total == 60,
            what="batches on ranks 0 and 1",
        )
        assert [stream(snap, r).duplicate_stream for r in (0, 1, 2)] == [True, True, False]
        # rank 1's port carries rank 0's bytes, rank label 0 included
        assert stream(snap, 1).rank_mismatch_batches == 60


async def test_a_duplicate_streams_since_stays_at_its_first_sign(sims: Sims) -> None:
    """Issue 21: the duplicate_stream condition's since kept resetting to "1 s ago" while the
    second publisher went on; it is when the second publisher was first seen, in every view."""
    faults = FaultConfig(second_publisher=(1,))
    sim = sims.start(sim_config("vllm-0.33", rate=100.0, max_batches=0, faults=faults), held=True)
    async with running_collector(sim_collector_config(sim)) as col:
        await wait_connected(col, sim)
        first = await wait_snapshot(
            col, lambda s: stream(s, 1).duplicate_stream, timeout_s=5.0, what="duplicate stream"
        )
        detected = time.time()

        def since(snap: Snapshot) -> float:
            state = FleetState()
            state.update(snap, snap.time)
            (c,) = [c for c in active(state.view(snap.time)) if c.kind == "duplicate_stream"]
            return c.since

        start = since(first)
        assert 0 < start <= detected
        # the evidence moves on for 2 s: the start does not
        later = await wait_snapshot(
            col,
            lambda s: stream(s, 1).last_duplicate_time >= stream(first, 1).last_duplicate_time + 2,
            timeout_s=10.0,
            what="two more seconds of a second publisher",
        )
        assert stream(later, 1).duplicate_stream
        assert since(later) == start == stream(later, 1).duplicate_since
