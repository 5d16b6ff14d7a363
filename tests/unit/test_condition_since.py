"""A condition's `since` is when it began: stable across evaluations, and one collector's loss
carries one start in every condition it causes (issue 21, "Times and storms")."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvobserve.aggregator import Aggregator
from kvobserve.analysis.conditions import DOWN_AFTER_S, THRASH_MIN_STORES, Condition, active, began
from kvobserve.analysis.fleet import FleetState
from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.export.api import alerts_json, every_alert
from kvobserve.wire.snapshot import (
    CollectorInfo,
    DriftStats,
    MediumStats,
    SchedulerStats,
    Snapshot,
    StreamStats,
    WorkerInfo,
)

T0 = 1000.0


class Clock:
    """A settable wall clock."""

    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _snap(
    seq: int, t: float, streams: list[StreamStats], cid: str = "node-1", **kw: object
) -> Snapshot:
    """Collector `cid` (node_rank 1) owning ranks 4 and 5 of w, reporting every second."""
    return Snapshot(
        CollectorInfo(cid, 1, "gpu-1", 1.0),
        seq=seq,
        time=t,
        interval_s=1.0,
        workers=[WorkerInfo("w", "sglang", 8, [4, 5], False)],
        streams=streams,
        **kw,  # type: ignore[arg-type]
    )


def _since(agg: Aggregator, kind: str) -> list[float]:
    """The `since` of every condition of `kind`, as the API serves it (view order)."""
    return [a["since"] for a in every_alert(alerts_json(agg.view())) if a["kind"] == kind]


async def _run(
    agg: Aggregator, clock: Clock, snaps: Callable[[int, float], Snapshot], n: int, kind: str
) -> list[list[float]]:
    """Feed one snapshot a second for `n` seconds, checking conditions as the aggregator does;
    the `since` of the conditions of `kind` after each second, read between two checks."""
    got = []
    for i in range(n):
        clock.t = T0 + i
        agg.apply(snaps(i, clock.t))
        await agg.check_conditions()
        clock.t += 0.5
        got.append(_since(agg, kind))
    return got


# --- one kind at a time: evidence that moves while the condition lasts --------------------------


async def test_duplicate_stream_since_is_the_first_sign_of_the_second_publisher() -> None:
    """Seen: the condition's since kept resetting to "1 s ago" (it was the latest evidence)."""
    clock = Clock()
    agg = Aggregator(FleetState(), clock=clock)

    def snap(i: int, t: float) -> Snapshot:
        st = StreamStats("w", 4, up=True, state="duplicate", state_since=T0 - 300, batches_total=9 + i,
                         state_complete=False, duplicate_stream=True,
                         last_duplicate_time=t - 0.1, duplicate_since=T0 - 120)  # fmt: skip
        return _snap(i, t, [st])

    for i in range(5):
        clock.t = T0 + i
        agg.apply(snap(i, clock.t))
        await agg.check_conditions()
        assert _since(agg, "duplicate_stream") == [T0 - 120], i


async def test_duplicate_stream_of_an_older_collector_keeps_the_time_it_was_first_seen() -> None:
    """A collector without duplicate_since: the first evidence the aggregator saw, held still."""
    clock = Clock()
    agg = Aggregator(FleetState(), clock=clock)

    def snap(i: int, t: float) -> Snapshot:
        st = StreamStats("w", 4, up=True, state="duplicate", state_since=T0 - 300, batches_total=9,
                         state_complete=True, duplicate_stream=True, last_duplicate_time=t - 0.1)  # fmt: skip
        return _snap(i, t, [st])

    assert await _run(agg, clock, snap, 5, "duplicate_stream") == [[T0 - 0.1]] * 5


def test_the_sequencer_dates_a_duplicate_episode_from_its_first_evidence() -> None:
    sq = StreamSequencer(dp_rank=0, replay=False)
    for t in (10.0, 10.5, 11.0, 12.0):
        sq.mark_duplicate_stream(t)
    assert (sq.duplicate_stream_began, sq.duplicate_stream_seen) == (10.0, 12.0)
    quiet = sq.limits.quiet_s
    assert not sq.duplicate_stream(12.0 + quiet)
    sq.mark_duplicate_stream(12.0 + quiet + 1)  # a new episode after the quiet time
    assert sq.duplicate_stream_began == 12.0 + quiet + 1


async def test_sequence_gap_since_is_the_first_gap_while_gaps_go_on() -> None:
    clock = Clock()
    agg = Aggregator(FleetState(), clock=clock)

    def snap(i: int, t: float) -> Snapshot:
        gap_at = T0 if i < 2 else T0 + 2  # a second gap at T0 + 2: the same condition
        st = StreamStats("w", 4, up=True, state="up", state_since=T0 - 300, batches_total=50,
                         state_complete=True, gaps=1 + (i >= 2), missed=3, recovered=3,
                         last_gap_time=gap_at)  # fmt: skip
        return _snap(i, t, [st])

    assert await _run(agg, clock, snap, 4, "sequence_gap") == [[T0]] * 4


async def test_cache_near_full_since_is_when_usage_first_crossed() -> None:
    clock = Clock()
    agg = Aggregator(FleetState(), clock=clock)

    def snap(i: int, t: float) -> Snapshot:
        st = StreamStats("w", 4, up=True, state="up", state_since=T0 - 300, state_complete=True)
        sch = SchedulerStats("w", 4, "metrics", 30, 0, 0.97, 0.5, 1000, updated=t - 0.2)
        return _snap(i, t, [st], scheduler=[sch])

    assert await _run(agg, clock, snap, 4, "cache_near_full") == [[T0 - 0.2]] * 4


async def test_router_index_drift_since_is_the_first_comparison_that_drifted() -> None:
    clock = Clock()
    agg = Aggregator(FleetState(), clock=clock)

    def snap(i: int, t: float) -> Snapshot:
        st = StreamStats("w", 4, up=True, state="up", state_since=T0 - 300, state_complete=True)
        d = DriftStats("w", 4, "GPU", "dump", 100, 100, 40, 0, at=t - 0.3)
        return _snap(i, t, [st], drift=[d])

    assert await _run(agg, clock, snap, 4, "router_index_drift") == [[T0 - 0.3]] * 4


async def test_stream_down_since_survives_its_state_changing_while_down() -> None:
    """connecting -> not_publisher -> connecting: one outage, one start."""
    clock = Clock()
    agg = Aggregator(FleetState(), clock=clock)
    states = [("connecting", T0 - 60), ("not_publisher", T0 + 1), ("connecting", T0 + 2)]

    def snap(i: int, t: float) -> Snapshot:
        state, since = states[min(i, 2)]
        st = StreamStats("w", 4, up=False, state=state, reason="r", state_since=since)
        return _snap(i, t, [st])

    assert await _run(agg, clock, snap, 4, "stream_down") == [[T0 - 60]] * 4


async def test_a_condition_without_evidence_of_its_start_is_dated_by_its_first_check() -> None:
    clock = Clock()
    agg = Aggregator(FleetState(), clock=clock)

    def snap(i: int, t: float) -> Snapshot:
        # thrash: what a rank's counters show since its collector started, with no start of its own
        media = [MediumStats("GPU", stored_total=THRASH_MIN_STORES, restored_total=900)]
        st = StreamStats("w", 4, up=True, state="up", state_since=T0 - 300, batches_total=5,
                         media=media)  # fmt: skip
        return _snap(i, t, [st])

    agg.apply(snap(0, T0))
    assert _since(agg, "cache_thrash") == [None]  # not checked yet: unknown, not "now"
    assert await _run(agg, clock, snap, 3, "cache_thrash") == [[T0]] * 3


def test_began_keeps_the_earliest_known_start() -> None:
    c = Condition("sequence_gap", "info", (("worker_id", "w"),), "gap", since=20.0)
    assert began(c, None).since == 20.0
    assert began(c, 10.0).since == 10.0
    assert began(c, 30.0).since == 20.0  # evidence older than the first check
    assert began(Condition("sequence_gap", "info", (), "gap"), None, 50.0).since == 50.0
    assert began(Condition("sequence_gap", "info", (), "gap"), None).since == 0.0


# --- one collector lost: one start -------------------------------------------------------------


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "fresh-aggregator"])
async def test_a_lost_collector_and_its_streams_and_ranks_carry_one_start(checked: bool) -> None:
    """Seen: "silent since 07:20:08" on stream_down and 07:20:18 on collector_down."""
    clock = Clock()
    agg = Aggregator(FleetState(), clock=clock)
    last = T0 + 10  # the lost collector's last snapshot
    up = StreamStats("w", 4, up=True, state="idle", reason="no batch for 10 s", state_since=T0,
                     batches_total=9, state_complete=True)  # fmt: skip
    idle_since_t0 = StreamStats("w", 5, up=True, state="up", state_since=T0 - 30, batches_total=9,
                                state_complete=True)  # fmt: skip
    agg.apply(_snap(1, last, [up, idle_since_t0]))
    other = Snapshot(CollectorInfo("node-0", 0, "gpu-0", 1.0), seq=1, time=last, interval_s=1.0,
                     workers=[WorkerInfo("w", "sglang", 8, [0, 1, 2, 3, 6, 7], True)])  # fmt: skip
    if checked:
        await agg.check_conditions()
    for t in range(11, 30):  # node-0 goes on; node-1 is silent from T0 + 10
        clock.t = T0 + t
        agg.apply(Snapshot(other.collector, seq=t, time=clock.t, interval_s=1.0,
                           workers=other.workers))  # fmt: skip
        if checked:
            await agg.check_conditions()
    got = {
        (a["kind"], a["labels"].get("dp_rank")): a["since"]
        for a in every_alert(alerts_json(agg.view()))
    }
    assert got == {
        ("collector_down", None): last,
        ("stream_down", "4"): last,
        ("stream_down", "5"): last,
        ("dp_rank_uncovered", "4"): last,
        ("dp_rank_uncovered", "5"): last,
    }


def test_a_stream_down_before_its_collector_was_lost_keeps_its_own_start() -> None:
    clock = Clock(T0 + 30)
    agg = Aggregator(FleetState(), clock=clock)
    refused = StreamStats("w", 4, up=False, state="connecting", reason="connection refused",
                          state_since=T0)  # fmt: skip
    settling = StreamStats("w", 5, up=False, state="connecting", reason="connection refused",
                           state_since=T0 + 8)  # fmt: skip
    agg.apply(_snap(1, T0 + 10, [refused, settling]), received=T0 + 10)
    got = {
        (a["kind"], a["labels"].get("dp_rank")): a["since"]
        for a in every_alert(alerts_json(agg.view()))
    }
    assert got[("stream_down", "4")] == T0  # down for 10 s when the collector went
    assert got[("stream_down", "5")] == T0 + 10  # 2 s only: it went down with its collector


def test_an_uncovered_rank_names_the_collector_that_owned_it_last() -> None:
    clock = Clock(T0 + 100)
    state = FleetState()
    old = Snapshot(CollectorInfo("node-1", 1, "gpu-1", 1.0), seq=1, time=T0, interval_s=1.0,
                   workers=[WorkerInfo("w", "sglang", 8, [4, 5], False)])  # fmt: skip
    newer = Snapshot(CollectorInfo("node-1b", 1, "gpu-1b", 1.0), seq=1, time=T0 + 50,
                     interval_s=1.0, workers=[WorkerInfo("w", "sglang", 8, [5], False)])  # fmt: skip
    live = Snapshot(CollectorInfo("node-0", 0, "gpu-0", 1.0), seq=1, time=clock.t, interval_s=1.0,
                    workers=[WorkerInfo("w", "sglang", 8, [0, 1, 2, 3], True)])  # fmt: skip
    for s, received in ((old, T0), (newer, T0 + 50), (live, clock.t)):
        state.update(s, received)
    v = state.view(clock.t)
    assert {k: c.info.collector_id for k, c in v.last_owner.items()} == {
        ("w", 4): "node-1",
        ("w", 5): "node-1b",  # the one seen last
    }
    unc = {dict(c.labels)["dp_rank"]: c for c in active(v) if c.kind == "dp_rank_uncovered"}
    assert set(unc) == {"4", "5"}  # at once: their collector is down
    assert dict(unc["5"].labels) == {"worker_id": "w", "dp_rank": "5", "node_rank": "1",
                                     "collector": "node-1b"}  # fmt: skip
    assert unc["5"].since == T0 + 50
    # never owned by anyone: no owner to name; uncovered once so for DOWN_AFTER_S (the
    # collectors of a fleet that starts send their first snapshots a moment apart), since the
    # first view that saw it so
    later = clock.t + DOWN_AFTER_S
    state.update(Snapshot(live.collector, seq=2, time=later, interval_s=1.0,
                          workers=live.workers), later)  # fmt: skip
    unc = {dict(c.labels)["dp_rank"]: c for c in active(state.view(later))
           if c.kind == "dp_rank_uncovered"}  # fmt: skip
    assert set(unc) == {"4", "5", "6", "7"}
    assert dict(unc["6"].labels) == {"worker_id": "w", "dp_rank": "6"}
    assert unc["6"].since == clock.t


def test_an_unvouched_index_warns_after_unvouched_warn_s_with_what_is_certain() -> None:
    def view(unvouched_for: float) -> list[Condition]:
        st = StreamStats("w", 0, up=True, state="up", batches_total=5, vouched=False,
                         vouch_reason="joined_midstream", vouched_since=T0 - unvouched_for,
                         lower_tokens=4096)  # fmt: skip
        fs = FleetState(unvouched_warn_s=600.0)
        fs.update(_snap(1, T0, [st]), T0)
        return [c for c in active(fs.view(T0)) if c.kind == "index_incomplete"]

    assert view(599.0) == []
    (c,) = view(601.0)
    assert (c.severity, c.since) == ("warning", T0 - 601.0)
    assert "cannot see this rank's cache for 10 min (joined_midstream)" in c.description
    assert "at least 4,096 tokens are resident" in c.description
