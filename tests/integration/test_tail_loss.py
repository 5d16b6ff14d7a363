"""Acceptance: a batch lost at the end of a burst is found while its publisher idles (issue 21,
Seen 5). A gap shows only when the next batch arrives; an idle stream's tail check asks the
replay ring for anything after its last seq instead (docs/stream-semantics.md, "Tail checks")."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from kvobserve.analysis.conditions import active
from kvobserve.commands.embedded import start_embedded
from kvobserve.simulate import FaultConfig, SimConfig, SimulatedWorker
from kvobserve.simulate.profiles import PROFILES
from kvobserve.sources.ingest_options import IngestOptions
from tests.integration.collector_helpers import (
    Sims,
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
from tests.polling import until_async

pytestmark = pytest.mark.integration


async def test_the_last_batch_of_a_burst_is_recovered_while_the_publisher_idles(
    sims: Sims,
) -> None:
    """The `tail` profile: rank 1 loses seq 39 on the wire (it stays in the ring), then stays up
    and silent; here the silence lasts 60 s, so the recovery cannot come from a later batch."""
    faults = dataclasses.replace(PROFILES["tail"], stall_s=60.0)
    sim = sims.start(
        sim_config("sglang-0.5.23", rate=200.0, topic="kv-events", faults=faults), held=True
    )
    async with running_collector(sim_collector_config(sim)) as col:
        await wait_connected(col, sim)
        snap = await wait_snapshot(
            col,
            lambda s: stream(s, 1).recovered == 1 and not stream(s, 1).replaying,
            what="rank 1's lost tail recovered, its replay ended",
        )
        inst = truth_instance(sim.truth(), 1)
        assert inst["batches"] == 40 and inst["live_dropped_seqs"] == [39]  # silent since 39
        st = stream(snap, 1)
        assert (st.gaps, st.missed, st.recovered, st.lost, st.batches_total) == (1, 1, 1, 0, 40)
        assert st.replay_requests == {"ok": 1}
        assert (st.trust, st.trust_reason) == ("replay_filled", "gap_replayed")
        assert st.last_gap_time > 0  # the sequence_gap condition holds for 15 minutes from it
        assert await resident(col, "w", 1) == truth_resident(inst)
        gap = [(e.first_seq, e.last_seq, e.message) for e in snap.events if e.kind == "gap"]
        assert gap == [(39, 39, "gap: seq 39 missed (1); recovered by replay")]

        # rank 0 lost nothing: once idle, its checks cost a request each and count nothing
        await until_async(
            lambda: sim.truth()["ranks"]["0"]["replay_requests"] >= 1, 10.0, "rank 0 checked"
        )
        truth = sim.truth()
        assert truth["ranks"]["0"]["replay_batches"] == 0  # an end marker alone
        st0 = stream(await col.snapshot(), 0)
        assert (st0.gaps, st0.missed, st0.replay_requests, st0.batches_total) == (0, 0, {}, 60)
        assert (st0.trust, st0.trust_reason) == ("complete", "from_start")
        assert await resident(col, "w", 0) == truth_resident(truth_instance(truth, 0))


async def test_seen_5_sglang_0_5_23_every_17th_batch_dropped_the_last_one_too() -> None:
    """The issue's measurement with the real SGLang 0.5.23 publisher: 306 batches per rank, every
    17th lost on the wire (seqs 16, 33, ..., 305; all still in the ring), then idle with the
    publisher up. Before tail checks every rank showed gaps 17 of 18 and applied 305 of 306."""
    dropped = list(range(16, 306, 17))
    assert len(dropped) == 18 and dropped[-1] == 305
    sim = SimulatedWorker(
        SimConfig(
            worker_id="w", format="sglang-0.5.23", dp_size=8, topic="kv-events", rate=200.0,
            max_batches=306, start_delay_s=0.5, http_port=None, prompts=40,
            faults=FaultConfig(drop_seqs=frozenset({16}), period=17),
        )
    ).start()  # fmt: skip
    try:
        emb = await start_embedded([sim_collector_config(sim)], http=None)
        try:
            (col,) = emb.collectors
            await wait_connected(col, sim)
            view = emb.aggregator.view

            def settled() -> bool:
                streams = [sv.stats for sv in view().streams]
                return len(streams) == 8 and all(
                    (s.gaps, s.batches_total, s.replaying) == (18, 306, False) for s in streams
                )

            await until_async(settled, 20.0, "gaps 18 and 306 batches applied on every rank")
            truth = sim.truth()
            conditions = {  # the streams' (the pool's miss split has its own)
                (c.kind, labels["dp_rank"]): c
                for c in active(view())
                if "dp_rank" in (labels := dict(c.labels))
            }
            events = list(emb.aggregator.events)
            for sv in view().streams:
                st, r = sv.stats, sv.stats.dp_rank
                inst = truth_instance(truth, r)
                assert inst["live_dropped_seqs"] == dropped and inst["batches"] == 306
                assert (st.gaps, st.missed, st.recovered, st.lost) == (18, 18, 18, 0)
                assert st.batches_total == 306 and st.state_complete
                assert await resident(col, "w", r) == truth_resident(inst)
                gap = conditions[("sequence_gap", str(r))]
                assert "18 in total: 18 batches missed, 18 recovered, 0 lost" in gap.description
                assert ("events_lost", str(r)) not in conditions
                assert ("index_incomplete", str(r)) not in conditions
                tail = [e for e in events if e.get("dp_rank") == r and e.get("first_seq") == 305]
                assert [e["message"] for e in tail] == [
                    "gap: seq 305 missed (1); recovered by replay"
                ]
            assert sim.truth()["ranks"]["7"]["instances"][0]["batches"] == 306  # still up, idle
        finally:
            await emb.close()
    finally:
        await asyncio.get_running_loop().run_in_executor(None, sim.stop)


async def test_without_a_replay_endpoint_an_idle_tail_is_unverified(sims: Sims) -> None:
    """Nobody can be asked: the trust keeps its state (nothing is known to be missing) and says
    the tail is unverified while the stream is idle."""
    sim = sims.start(sim_config("vllm-0.33", replay_port=None, rate=200.0), held=True)
    async with running_collector(sim_collector_config(sim)) as col:
        await wait_connected(col, sim)
        snap = await wait_snapshot(
            col,
            lambda s: all(x.batches_total == 60 for x in s.streams),
            what="every batch applied",
        )
        # while batches arrive (and for 2 s after the last one) the next batch would tell
        assert {(s.trust, s.trust_reason) for s in snap.streams} <= {("complete", "from_start"),
                                                                    ("complete", "tail_unverified")}  # fmt: skip
        snap = await wait_snapshot(
            col,
            lambda s: all(x.trust_reason == "tail_unverified" for x in s.streams),
            what="idle tails unverified",
        )
        for s in snap.streams:
            assert (s.trust, s.state_complete, s.gaps, s.lost) == ("complete", True, 0, 0)


async def test_a_tail_check_facing_a_restarted_publisher_corrupts_nothing(sims: Sims) -> None:
    """The engine restarts while the SUB is away and its new publisher sends 100 batches before
    the SUB is back, then idles: its ring holds seqs past ours, but they are not our stream's.
    The check after the reconnect asks from our last seq and finds another batch under it: a
    restart, the index starts again, and later the new publisher's history is replayed from 0."""
    old = sims.start(sim_config("sglang-0.5.23", dp_size=1, max_batches=30, rate=200.0), held=True)
    slow = IngestOptions(reconnect_ivl_ms=3000, reconnect_ivl_max_ms=3000)  # away 3 s per retry
    async with running_collector(sim_collector_config(old), ingest=slow) as col:
        await wait_connected(col, old)
        await wait_snapshot(col, lambda s: stream(s, 0).batches_total == 30, what="old: 30")
        old.stop()
        new = sims.start(
            sim_config(
                "sglang-0.5.23", dp_size=1, max_batches=120, rate=1000.0, start_delay_s=0.0,
                kv_port=old.kv_base, replay_port=old.replay_base, seed=7,
                faults=FaultConfig(stall_after=100, stall_s=10.0),
            )
        )  # fmt: skip
        await until_async(
            lambda: truth_instance(new.truth(), 0)["batches"] == 100, 5.0, "new: 100, paused"
        )
        snap = await wait_snapshot(
            col, lambda s: stream(s, 0).restarts == 1, what="the check saw another publisher"
        )
        st = stream(snap, 0)
        assert truth_instance(new.truth(), 0)["batches"] == 100  # found while it was silent
        assert (st.batches_total, st.gaps, st.missed, st.lost) == (30, 0, 0, 0)  # none of its
        assert await resident(col, "w", 0) == {}  # the old publisher's blocks are gone
        assert (st.trust, st.trust_reason) == ("partial", "waiting")
        assert any("publisher restarted while away" in e.message for e in snap.events)
        # the new publisher goes on at seq 100: joined mid-stream, replayed from 0, exact
        snap = await wait_snapshot(
            col,
            lambda s: stream(s, 0).batches_total == 30 + 120 and stream(s, 0).trust == "complete",
            what="the new publisher's whole history applied",
        )
        st = stream(snap, 0)
        assert (st.trust_reason, st.gaps, st.lost, st.restarts) == ("replayed_from_start", 0, 0, 1)
        assert await resident(col, "w", 0) == truth_resident(truth_instance(new.truth(), 0))
