"""Acceptance: batches lost on the wire are replayed from the engine's ring, or counted lost."""

from __future__ import annotations

import pytest

from kvobserve.simulate import FaultConfig
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

pytestmark = pytest.mark.integration
DROPPED = frozenset({10, 11, 12, 50})  # two gaps: 3 batches, then 1


# sglang-0.5.12 replies with 3 frames, vllm-0.33 with 4 (topic)
@pytest.mark.parametrize("fmt", ["sglang-0.5.12", "vllm-0.33"])
async def test_live_drops_kept_in_the_ring_are_recovered(fmt: str, sims: Sims) -> None:
    sim = sims.start(
        sim_config(fmt, topic="kv-events", faults=FaultConfig(drop_seqs=DROPPED)), held=True
    )
    async with running_collector(sim_collector_config(sim)) as col:
        await wait_connected(col, sim)
        snap = await wait_snapshot(
            col,
            all_streams(lambda s: s.batches_total == 60 and not s.replaying),
            what="every batch applied, replays done",
        )
        truth = sim.truth()
        for r in (0, 1):
            inst = truth_instance(truth, r)
            assert set(inst["live_dropped_seqs"]) == DROPPED
            st = stream(snap, r)
            assert (st.gaps, st.missed, st.recovered, st.lost) == (2, 4, 4, 0)
            # one replay per gap; on a loaded machine the second gap can be seen while the first
            # replay is being asked for, and one replay recovers both
            assert st.replay_requests in ({"ok": 2}, {"ok": 1})
            assert st.state_complete is True
            assert await resident(col, "w", r) == truth_resident(inst)


async def test_without_a_replay_endpoint_drops_are_lost(sims: Sims) -> None:
    sim = sims.start(
        sim_config("sglang-0.5.23", replay_port=None, faults=FaultConfig(drop_seqs=DROPPED)),
        held=True,
    )
    async with running_collector(sim_collector_config(sim)) as col:
        await wait_connected(col, sim)
        snap = await wait_snapshot(
            col, all_streams(lambda s: s.batches_total == 60 - len(DROPPED)), what="batches applied"
        )
        for r in (0, 1):
            st = stream(snap, r)
            assert (st.gaps, st.missed, st.recovered, st.lost) == (2, 4, 0, 4)
            assert st.replay_requests == {}
            assert st.state_complete is False


async def test_drops_missing_from_the_ring_are_lost_the_rest_recovered(sims: Sims) -> None:
    faults = FaultConfig(ranks=(1,), drop_seqs=frozenset({10, 11}), ring_drop_seqs=frozenset({20}))
    sim = sims.start(sim_config("sglang-0.5.23", faults=faults), held=True)
    async with running_collector(sim_collector_config(sim)) as col:
        await wait_connected(col, sim)
        snap = await wait_snapshot(
            col,
            lambda s: (
                [x.batches_total for x in s.streams] == [60, 59]
                and stream(s, 1).missed == 3
                and not stream(s, 1).replaying
            ),
            what="every batch applied, replays done",
        )
        truth = sim.truth()
        st0, st1 = stream(snap, 0), stream(snap, 1)
        assert (st0.gaps, st0.missed, st0.lost, st0.replay_requests) == (0, 0, 0, {})
        assert st0.state_complete is True
        assert (st1.gaps, st1.missed, st1.recovered, st1.lost) == (2, 3, 2, 1)
        # one replay per gap; on a loaded machine the second gap can be seen while the first
        # replay is being asked for, and both are recovered by one (partial) replay
        assert st1.replay_requests in ({"ok": 1, "partial": 1}, {"partial": 1})
        assert st1.state_complete is False
        assert await resident(col, "w", 0) == truth_resident(truth_instance(truth, 0))


async def test_frequent_live_drops_at_a_high_rate_are_all_recovered(sims: Sims) -> None:
    # drops keep coming while replays are in flight: holes younger than a reply are asked again
    dropped = frozenset(s for s in range(5, 990) if s % 10 == 3 or s % 17 == 0)
    sim = sims.start(
        sim_config(
            "vllm-0.33", rate=2000.0, max_batches=1000, faults=FaultConfig(drop_seqs=dropped)
        ),
        held=True,
    )
    async with running_collector(sim_collector_config(sim)) as col:
        await wait_connected(col, sim)
        snap = await wait_snapshot(
            col,
            all_streams(lambda s: s.batches_total == 1000 and not s.replaying),
            what="every batch applied, replays done",
        )
        truth = sim.truth()
        for r in (0, 1):
            st = stream(snap, r)
            assert (st.missed, st.recovered, st.lost) == (len(dropped), len(dropped), 0)
            assert st.replay_requests.keys() == {"ok"}
            assert st.state_complete is True
            assert await resident(col, "w", r) == truth_resident(truth_instance(truth, r))
