"""Configured parts a collector cannot watch: one condition each, their series, and the ranks
they leave uncovered grouped under them (docs/collector.md "Worker states")."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvobserve.analysis.conditions import Condition, active, grouped
from kvobserve.analysis.fleet import FleetState
from kvobserve.export.prometheus import FleetCollector
from kvobserve.sources.scheduler import KvMetricsPull, LoadSubscriber
from kvobserve.wire.snapshot import CollectorInfo, Snapshot, SourceState, StreamStats, WorkerInfo

NOW = 10_000.0
GONE = "connection refused at http://10.0.0.9:30000/server_info"
FIX = (
    "the engine runs on 2 nodes, [collector] nnodes is 1; set [collector] nnodes = 2 and run a "
    "collector on each node"
)


def _snap(
    cid: str,
    node: int,
    workers: list[WorkerInfo],
    streams: list[StreamStats] | None = None,
    sources: list[SourceState] | None = None,
) -> Snapshot:
    info = CollectorInfo(cid, node, f"host-{node}", 1.0)
    return Snapshot(info, seq=1, time=NOW, workers=workers, streams=streams or [],
                    sources=sources or [])  # fmt: skip


def _state(*snaps: tuple[Snapshot, float]) -> FleetState:
    state = FleetState()
    for snap, received in snaps:
        state.update(snap, received)
    return state


def _kinds(conds: list[Condition]) -> list[tuple[str, tuple[tuple[str, str], ...]]]:
    return [(c.kind, c.labels) for c in conds]


def test_an_undiscovered_worker_is_one_critical_condition_while_its_collector_lives() -> None:
    w = WorkerInfo("sglang-c", "sglang", 0, [], False, 0, "undiscovered", GONE, NOW - 30)
    live = _state((_snap("node-1", 1, [w]), NOW))
    (c,) = active(live.view(NOW))
    assert (c.kind, c.severity, c.since) == ("worker_undiscovered", "critical", NOW - 30)
    assert dict(c.labels) == {"worker_id": "sglang-c", "node_rank": "1", "collector": "node-1"}
    assert c.description == f"sglang-c on node-1: undiscovered: {GONE}"
    assert live.conditions(NOW) == active(live.view(NOW))  # the per-second check sees it
    # a silent collector's word is stale: collector_down says it, not the worker
    stale = _state((_snap("node-1", 1, [w]), NOW - 10))
    assert [c.kind for c in active(stale.view(NOW))] == ["collector_down"]


def test_a_layout_mismatch_is_the_cause_of_the_ranks_it_leaves_uncovered() -> None:
    mism = WorkerInfo("w8", "sglang", 8, [0, 1, 2, 3], True, 0, "layout_mismatch", FIX, NOW - 5,
                      [4, 5, 6, 7])  # fmt: skip
    other = WorkerInfo("w2", "sglang", 2, [0], True, 0, "watching", "1 of 2 ranks", NOW - 5)
    streams = [StreamStats("w8", r, up=True, state="up", state_complete=True) for r in range(4)]
    streams.append(StreamStats("w2", 0, up=True, state="up", state_complete=True))
    state = _state((_snap("box", 0, [mism, other], streams=streams), NOW))
    state.view(NOW - 10)  # the ranks have had no owner for 10 s (a rank counts after 5 s)
    v = state.view(NOW)
    groups = [(c.kind, c.labels, _kinds(then)) for c, then in grouped(active(v))]
    assert groups == [
        ("layout_mismatch", (("worker_id", "w8"), ("node_rank", "0"), ("collector", "box")),
         [("dp_rank_uncovered", (("worker_id", "w8"), ("dp_rank", str(r)))) for r in range(4, 8)]),
        # another worker's uncovered rank is a cause of its own
        ("dp_rank_uncovered", (("worker_id", "w2"), ("dp_rank", "1")), []),
    ]  # fmt: skip
    assert active(v)[0].description == (
        f"w8 on box: {FIX} (ranks 4-7 are not watched here: the engine does not run them on this "
        "node)"
    )
    assert state.conditions(NOW) == active(v)
    assert [v.owners[("w8", r)] for r in range(8)] == [["box"]] * 4 + [[]] * 4  # still true


@pytest.mark.parametrize(
    ("state", "age", "raised"),
    [("down", 10.0, True), ("undecodable", 10.0, True), ("down", 1.0, False), ("up", 60.0, False)],
)
def test_a_scheduler_source_down_for_5_s_is_a_warning(state: str, age: float, raised: bool) -> None:
    src = SourceState("w", "metrics", "http://10.0.0.5:30000/metrics", state, "cannot connect: "
                      "connection refused", NOW - age, 3)  # fmt: skip
    snap = _snap("node-0", 0, [WorkerInfo("w", "sglang", 0, [], True)], sources=[src])
    got = [c for c in active(_state((snap, NOW)).view(NOW)) if c.kind != "dp_rank_uncovered"]
    if not raised:
        assert got == []
        return
    (c,) = got
    assert (c.kind, c.severity, c.since) == ("scheduler_source_down", "warning", NOW - age)
    assert dict(c.labels) == {
        "worker_id": "w", "node_rank": "0", "collector": "node-0", "source": "metrics"
    }  # fmt: skip
    assert c.description == (
        f"w scheduler source metrics (http://10.0.0.5:30000/metrics) on node-0 is {state}: "
        "cannot connect: connection refused"
    )


def test_their_series_exist_only_in_trouble_and_only_for_live_collectors() -> None:
    bad = WorkerInfo("a", "sglang", 0, [], True, 0, "undiscovered", GONE, NOW)
    fine = WorkerInfo("b", "sglang", 2, [0, 1], True, 0, "watching", "2 of 2 ranks", NOW)
    down = SourceState("b", "load", "tcp://127.0.0.1:5565", "down", "no message for 10 s", NOW)
    up = SourceState("b", "metrics", "http://127.0.0.1:30000/metrics", "up", "scraping", NOW)
    gone = WorkerInfo("c", "sglang", 0, [], True, 0, "undiscovered", GONE, NOW)
    state = _state(
        (_snap("node-0", 0, [bad, fine], sources=[down, up]), NOW),
        (_snap("node-9", 9, [gone], sources=[down]), NOW - 60),  # silent: down
    )
    reg = CollectorRegistry(auto_describe=False)
    view = state.view(NOW)
    reg.register(FleetCollector(lambda: view))
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in reg.collect()
        for s in fam.samples
        if s.name in ("kvobserve_worker_state", "kvobserve_scheduler_source_state")
    }
    assert got == {
        ("kvobserve_worker_state", (("collector", "node-0"), ("node_rank", "0"),
                                    ("state", "undiscovered"), ("worker_id", "a"))): 1.0,
        ("kvobserve_scheduler_source_state", (("collector", "node-0"), ("node_rank", "0"),
         ("source", "load"), ("state", "down"), ("worker_id", "b"))): 1.0,
    }  # fmt: skip


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_silence_is_down_for_a_heartbeat_source_and_idle_for_kv_metrics() -> None:
    clock = _Clock()
    load = LoadSubscriber(["tcp://127.0.0.1:5565"], [0], clock=clock)
    push = KvMetricsPull("tcp://127.0.0.1:5570", clock=clock)
    clock.t = 109.0
    for s in (load, push):
        s.check_silence(10.0)
    assert load.health.state == push.health.state == "waiting"
    clock.t = 111.0
    for s in (load, push):
        s.check_silence(10.0)
    assert (load.health.state, load.health.reason, load.health.since) == (
        "down", "nothing received for 10 s (it sends every second while its engine runs)", 111.0
    )  # fmt: skip
    assert push.health.state == "waiting"  # it never sent: nothing to call idle
    push.last_message = 111.0
    push.health.set("up", "receiving", 111.0)
    clock.t = 125.0
    push.check_silence(10.0)
    assert (push.health.state, push.health.reason) == (
        "idle",
        "no message for 10 s (none is sent while the engine idles)",
    )
