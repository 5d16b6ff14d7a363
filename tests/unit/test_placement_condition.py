"""placement_misses over a trace replay: the aggregator's per-second condition path, a fake clock.

Issue 30 ("Healthy fleets warn"): the condition fired after 36 s of data and flapped five times
in 31 s (firing at 5 %, resolved at 10 %, firing at 12 %: the share was never the reason, the
split's trust was, as a publisher restart makes a rank's view partial for a moment). Here the
first seven minutes of the conversation trace (tests/fixtures/traces) are replayed on two ranks
of one pool, each watched by its own collector: each rank's batches go through its sequencer
into the collector's miss sampler, each collector sends a snapshot with its delta every engine
second, and the aggregator (its clock the trace's) applies them and runs its per-second
condition check, as `kvobserve aggregate` does. Every RESTART_EVERY_S rank 1's collector reports
its view partial for two seconds, as after a publisher restart (the demo restarts publishers every
50 s). A router that is not cache-aware (random) raises the condition once, after
PLACEMENT_MIN_S of evidence, and it does not resolve while the split is untrusted; a KV-aware
router never raises it.
"""

from __future__ import annotations

import itertools
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from kvobserve.aggregator import Aggregator
from kvobserve.analysis.conditions import (
    PLACEMENT,
    PLACEMENT_CLEAR,
    PLACEMENT_MIN_MISSES,
    PLACEMENT_MIN_S,
    PLACEMENT_SHARE,
    active,
    labels,
)
from kvobserve.analysis.fleet import FleetState
from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.analysis.views import FleetView, Key, PoolSplit, RecentSplit
from kvobserve.simulate.replay import replay_offline
from kvobserve.simulate.trace import TraceRequest, read_trace
from kvobserve.sources.miss_stats import MissSamplers
from kvobserve.wire.kv_events import decode_payload
from kvobserve.wire.snapshot import CollectorInfo, Snapshot, StreamStats, WorkerInfo

FIXTURE = Path(__file__).parents[1] / "fixtures" / "traces" / "mooncake-conversation.jsonl.gz"
T0 = 1_700_000_000.0  # the wall clock at the trace's time 0
SECONDS = 420.0  # the trace's first seven minutes
RANKS = 2
WORKER = "sglang-dp2"
PAGE = 128  # tokens per engine page (the fixture's blocks are 512)
RESTART_EVERY_S = 45.0  # rank 1's view is partial for 2 s every this often


@cache
def _trace() -> tuple[TraceRequest, ...]:
    return tuple(read_trace(str(FIXTURE), SECONDS))


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t


class Collector:
    """One collector watching one rank: its sequencer feeds the pool's sampler."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.samplers = MissSamplers({WORKER: WORKER})
        self.seq = StreamSequencer(rank, replay=False)
        self.samplers.attach(WORKER, rank, "sglang", self.seq)
        self.sent = 0

    def apply(self, seq: int, payload: bytes, now: float) -> None:
        self.seq.on_batch(decode_payload("", seq, payload), payload, now)

    def snapshot(self, now: float) -> Snapshot:
        self.sent += 1
        t = now - T0
        partial = self.rank == 1 and t > RESTART_EVERY_S and t % RESTART_EVERY_S < 2.0
        stream = StreamStats(WORKER, self.rank, up=True, state="up", state_complete=not partial,
                             batches_total=self.seq.batches_applied,
                             trust="partial" if partial else "complete",
                             block_size=PAGE)  # fmt: skip
        return Snapshot(
            CollectorInfo(f"node-{self.rank}", self.rank, f"gpu-{self.rank}", 1.0),
            seq=self.sent, time=now, interval_s=1.0,
            workers=[WorkerInfo(WORKER, "sglang", RANKS, [self.rank], self.rank == 0)],
            streams=[stream], misses=self.samplers.deltas(now - T0),
        )  # fmt: skip


@cache
def _replay(route: str) -> tuple[list[dict[str, Any]], list[tuple[float, float | None]]]:
    """The condition events of the replay (firing / resolved, as the aggregator logs them),
    and (seconds into the replay, the window's placement share; None while the split is not
    trusted) at every check with PLACEMENT_MIN_MISSES in the window."""
    clock = Clock()
    agg = Aggregator(FleetState(), clock=clock)
    nodes = [Collector(r) for r in range(RANKS)]
    events: list[dict[str, Any]] = []
    shares: list[tuple[float, float | None]] = []
    second = [1.0]

    def tick(until: float) -> None:
        """Every engine second up to `until`: snapshots, feedback, the condition check."""
        while second[0] <= until:
            clock.t = T0 + second[0]
            for n in nodes:
                agg.apply(n.snapshot(clock.t))
            fb = agg.fleet.misses.feedback(clock.t)
            for n in nodes:
                n.samplers.follow(fb, f"node-{n.rank}")
            events.extend(agg.transitions(agg.fleet.conditions(clock.t, agg.began())))
            split = agg.fleet.view(clock.t).misses[WORKER]
            r = split.recent
            if r is not None and r.total_misses >= PLACEMENT_MIN_MISSES:
                shares.append((second[0], r.share("placement") if split.trusted else None))
            second[0] += 1.0

    def on_batch(rank: int, seq: int, payload: bytes) -> None:
        ts = decode_payload("", seq, payload).ts
        tick(ts)
        nodes[rank].apply(seq, payload, T0 + ts)

    replay_offline(_trace(), ranks=RANKS, capacity_tokens=2_000_000, page_size=PAGE,
                   route=route, on_batch=on_batch)  # fmt: skip
    tick(SECONDS + 1.0)
    return [e for e in events if e["kind"] == PLACEMENT], shares


def test_a_router_that_ignores_the_cache_raises_it_once_on_enough_evidence() -> None:
    events, shares = _replay("random")
    assert [e["state"] for e in events] == ["firing"]  # once, and it never resolves
    (fired,) = events
    assert fired["severity"] == "info"  # information: a router that is simply not cache-aware
    at = float(fired["time"]) - T0
    assert at >= PLACEMENT_MIN_S  # not on the first seconds of data
    assert "% of its misses in the last 5 min" in str(fired["description"])
    # Not quiet by luck: after it fired the split was untrusted again and again (each time the
    # condition used to resolve and fire again), and the trusted share stayed over the clear
    # threshold
    after = [x for t, x in shares if t >= at]
    untrusted = sum(1 for a, b in itertools.pairwise(after) if a is not None and b is None)
    assert untrusted >= 2, untrusted
    assert min(x for x in after if x is not None) > PLACEMENT_SHARE
    # the miss count alone was enough within the first minute (the 36 s), and the share
    # crossed the firing threshold well before PLACEMENT_MIN_S
    assert shares[0][0] < 60.0
    crossed = next(t for t, x in shares if x is not None and x > PLACEMENT_SHARE)
    assert crossed < PLACEMENT_MIN_S - 60


def test_a_kv_aware_router_never_raises_it() -> None:
    events, shares = _replay("kv_aware")
    assert events == []
    judged = [x for t, x in shares if x is not None and t >= PLACEMENT_MIN_S]
    assert judged and max(judged) < PLACEMENT_CLEAR  # judged, and low


def _view(share: float, misses: float, seconds: float, trusted: bool, was: bool) -> FleetView:
    """A view of pool `p` alone: its window's misses, `share` of them placement."""
    recent = RecentSplit(seconds, {"compulsory": misses * (1 - share), "capacity": 0.0,
                                   "placement": misses * share}, None)  # fmt: skip
    split = PoolSplit("p", (), {}, 0.01, 5000, 1, trusted, () if trusted else ("rank_partial",),
                      "" if trusted else "down or partial: w rank 1", recent)  # fmt: skip
    began: dict[Key, float] = {(PLACEMENT, labels(pool="p")): T0} if was else {}
    return FleetView(now=T0 + 600, misses={"p": split}, began=began)


@pytest.mark.parametrize(
    ("share", "misses", "seconds", "trusted", "was", "found"),
    [
        # not active: it needs a judged window over PLACEMENT_SHARE
        (0.06, 20_000, 600, True, False, "raised"),
        (0.04, 20_000, 600, True, False, None),
        (0.06, 9_000, 600, True, False, None),  # too few misses
        (0.06, 20_000, 200, True, False, None),  # too short a window
        (0.30, 20_000, 600, False, False, None),  # not trusted
        # active: it holds until a judged window is under PLACEMENT_CLEAR, or nothing is missed
        (0.04, 20_000, 600, True, True, "raised"),
        (0.02, 20_000, 600, True, True, None),
        (0.02, 20_000, 600, False, True, "held"),
        (0.02, 9_000, 600, True, True, "held"),
        (0.00, 0, 600, True, True, None),
    ],
)
def test_it_fires_on_judged_evidence_and_clears_with_hysteresis(
    share: float, misses: float, seconds: float, trusted: bool, was: bool, found: str | None
) -> None:
    got = [c for c in active(_view(share, misses, seconds, trusted, was)) if c.kind == PLACEMENT]
    if found is None:
        assert got == []
        return
    (c,) = got
    assert c.severity == "info" and c.labels == (("pool", "p"),)
    assert c.description.startswith(f"pool p: {100 * share:.1f}% of its misses in the last ")
    assert ("so it holds" in c.description) == (found == "held"), c.description
