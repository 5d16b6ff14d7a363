"""Acceptance: resident blocks per stream equal the truth, for real engine bytes and every format."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvobserve.wire.kv_events import AllBlocksCleared, decode_message
from kvobserve.wire.snapshot import Snapshot
from tests.integration.collector_helpers import (
    CAPTURE_FOLDERS,
    SIM_FORMATS,
    Sims,
    all_streams,
    capture_publisher,
    collector_config,
    expected_event_counts,
    expected_resident,
    load_capture,
    resident,
    running_collector,
    sim_collector_config,
    sim_config,
    sim_finished,
    stream,
    truth_instance,
    truth_resident,
    wait_connected,
    wait_snapshot,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("folder", CAPTURE_FOLDERS)
async def test_capture_bytes_give_the_expected_block_sets(folder: str) -> None:
    cap = load_capture(folder)
    ranks = sorted(cap.live)
    assert ranks == [0, 1]
    # phase 1 stops before each rank's AllBlocksCleared, so the first compared set is not trivial
    split = {r: _clear_index(cap.live[r]) for r in ranks}
    phases = [{r: (0, split[r]) for r in ranks}, {r: (split[r], len(cap.live[r])) for r in ranks}]
    with capture_publisher(ranks) as pub:
        cfg = collector_config(
            cap.engine, kv_endpoint=pub.endpoint, dp_size=len(ranks), topic=cap.topic or None
        )
        async with running_collector(cfg) as col:
            await pub.wait_subscribed()
            for n, phase in enumerate(phases):
                for r, (lo, hi) in phase.items():
                    for _, frames in cap.live[r][lo:hi]:
                        pub.send(r, frames)
                done = {r: hi for r, (_, hi) in phase.items()}
                snap = await wait_snapshot(col, _applied(done), what=f"phase {n}: batches")
                for r in ranks:
                    batches = cap.expected[r][: done[r]]
                    assert await resident(col, cfg.workers[0].id, r) == expected_resident(batches)
                    st = stream(snap, r)
                    assert st.events == expected_event_counts(batches)
                    assert (st.gaps, st.missed, st.lost, st.restarts) == (0, 0, 0, 0)
                    assert st.rank_mismatch_batches == 0
                    assert st.decode_errors == {}
                    assert st.state_complete is True
    # the phase-1 sets held more than the one block left after the clear
    assert any(len(s) > 2 for s in expected_resident(cap.expected[0][: split[0]]).values())


def _applied(done: dict[int, int]) -> Callable[[Snapshot], bool]:
    """Every rank's stream applied exactly `done[rank]` batches."""
    return all_streams(lambda s: s.batches_total == done[s.dp_rank])


def _clear_index(live: list[tuple[int, list[bytes]]]) -> int:
    """Position of the first batch holding an AllBlocksCleared."""
    for i, (_, frames) in enumerate(live):
        if any(isinstance(e, AllBlocksCleared) for e in decode_message(frames).events):
            return i
    raise AssertionError("capture without AllBlocksCleared")


@pytest.mark.parametrize("fmt", SIM_FORMATS)
async def test_simulated_engines_give_the_truth_block_sets(fmt: str, sims: Sims) -> None:
    topic = "kv-events" if fmt.endswith(("0.5.23", "0.33")) else ""
    sim = sims.start(sim_config(fmt, topic=topic, max_batches=80), held=True)
    async with running_collector(sim_collector_config(sim)) as col:
        await wait_connected(col, sim)
        snap = await wait_snapshot(
            col, all_streams(lambda s: s.batches_total == 80), what="all batches applied"
        )
        assert sim_finished(sim)
        truth = sim.truth()
        for r in (0, 1):
            inst = truth_instance(truth, r)
            want = truth_resident(inst)
            assert want, "the simulated cache holds blocks"
            assert await resident(col, "w", r) == want
            st = stream(snap, r)
            counts = (st.gaps, st.missed, st.lost, st.restarts, st.duplicate_batches)
            assert counts == (0, 0, 0, 0, 0)
            assert st.replay_requests == {}
            assert st.state_complete is True
            assert sum(st.events.values()) == inst["events"]
            gpu = {m.medium: m.tokens for m in st.media}
            assert gpu == inst["resident_tokens"]
