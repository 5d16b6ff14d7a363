"""Scheduler data joined per (worker_id, dp_rank) across collectors, served under the rank's owner.

The leader reads worker-wide sources (here a KvMetrics PULL that hears every rank), node 1 reads
the load PUB of its own ranks: rank 2 arrives from both collectors and must come out once, with
node 1's node_rank, the freshest value per field, its capacity joined to the stream.
"""

from __future__ import annotations

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import scale
from kvobserve.analysis.conditions import Condition
from kvobserve.analysis.fleet import FleetState
from kvobserve.analysis.views import FleetView
from kvobserve.export.api import streams_json
from kvobserve.export.scrape import ScrapeCache
from kvobserve.export.series import Detail
from kvobserve.wire.snapshot import (
    CollectorInfo,
    MediumStats,
    SchedulerStats,
    Snapshot,
    StreamStats,
    WorkerInfo,
)
from tests.unit.test_export_scrape import check

NOW = 5000.0


def _stream(rank: int, tokens: int) -> StreamStats:
    return StreamStats(
        "w", rank, engine="sglang", endpoint=f"tcp://10.0.0.{5 + rank // 2}:{5557 + rank}",
        up=True, batches_total=10, media=[MediumStats("GPU", tokens // 16, tokens, 1, 0)],
        state_complete=True,
    )  # fmt: skip


def _state() -> FleetState:
    leader = Snapshot(
        CollectorInfo("node-0", 0, "gpu-0", 1000.0, "c", "x"),
        seq=1,
        time=NOW,
        workers=[WorkerInfo("w", "sglang", 4, [0, 1], True)],
        streams=[_stream(0, 160), _stream(1, 320)],
        scheduler=[  # KvMetrics from every rank's scheduler, rank 2 included
            SchedulerStats("w", 0, "kv_metrics", 3, 0, 0.25, 0.5, 1000, updated=NOW - 1),
            SchedulerStats("w", 2, "kv_metrics", 5, 1, 0.40, 0.7, 1000, updated=NOW - 2),
        ],
    )
    node1 = Snapshot(
        CollectorInfo("node-1", 1, "gpu-1", 1000.0, "c", "x"),
        seq=1,
        time=NOW,
        workers=[WorkerInfo("w", "sglang", 4, [2, 3], False)],
        streams=[_stream(2, 480), _stream(3, 640)],
        scheduler=[  # its own ranks' load PUB: fresher, no hit ratio
            SchedulerStats("w", 2, "load", 6, 2, 0.45, None, 2000, updated=NOW - 0.5),
        ],
    )
    fs = FleetState()
    fs.update(leader, NOW)
    fs.update(node1, NOW)
    return fs


def test_one_entry_per_rank_under_its_owner_freshest_field_wins() -> None:
    v = _state().view(NOW)
    got = {(s.worker_id, s.dp_rank): (s, info.collector_id) for s, info in v.scheduler}
    assert sorted(got) == [("w", 0), ("w", 2)]
    rank2, owner = got[("w", 2)]
    assert owner == "node-1"
    assert (rank2.running_requests, rank2.token_usage_ratio, rank2.max_total_tokens) == (
        6,
        0.45,
        2000,
    )
    assert rank2.cache_hit_ratio == 0.7  # only the leader's KvMetrics has it
    assert rank2.source == "kv_metrics+load"
    caps = {s.stats.dp_rank: (s.capacity_tokens, s.usage_ratio) for s in v.streams}
    assert caps == {0: (1000, 0.16), 1: (None, None), 2: (2000, 0.24), 3: (None, None)}


def test_api_says_which_source_or_none() -> None:
    streams = {s["dp_rank"]: s["scheduler_source"] for s in streams_json(_state().view(NOW))}
    assert streams == {0: "kv_metrics", 1: "none", 2: "kv_metrics+load", 3: "none"}


def test_metrics_serve_the_joined_rank_once_with_the_owners_node_rank() -> None:
    view = _state().view(NOW)
    body = check(ScrapeCache(Detail()), view, False).decode()
    samples = [
        (dict(s.labels), s.value)
        for fam in text_string_to_metric_families(body)
        for s in fam.samples
        if s.name == "kvobserve_scheduler_token_usage_ratio"
    ]
    assert samples == [
        ({"worker_id": "w", "node_rank": "0", "dp_rank": "0"}, 0.25),
        ({"worker_id": "w", "node_rank": "1", "dp_rank": "2"}, 0.45),
    ]


def test_a_new_leader_snapshot_reaches_the_owner_chunk() -> None:
    fs = _state()
    cache = ScrapeCache(Detail())
    check(cache, fs.view(NOW), False)
    leader = fs.snapshot("node-0")
    assert leader is not None
    moved = SchedulerStats("w", 2, "kv_metrics", 9, 9, 0.9, 0.1, 3000, updated=NOW + 1)
    fs.update(
        Snapshot(
            leader.collector, seq=2, time=NOW + 1, workers=leader.workers,
            streams=leader.streams, scheduler=[leader.scheduler[0], moved],
        ),
        NOW + 1,
    )  # fmt: skip
    body = check(cache, fs.view(NOW + 1), False).decode()  # cached == reference bytes
    line = 'kvobserve_scheduler_token_usage_ratio{dp_rank="2",node_rank="1",worker_id="w"} 0.9'
    assert line in body


def _seen(v: FleetView) -> tuple[object, ...]:
    """What a view serves (collectors without their serials: each FleetState numbers its own)."""
    return (
        [(c.info, c.up, c.age_s, c.snapshot) for c in v.collectors],
        v.streams, v.scheduler, v.dp_size, v.owners, v.leaders, v.unexpected, v.workers,
        v.sources, {k: c.info for k, c in v.last_owner.items()}, set(v.uncovered_since),
    )  # fmt: skip


def _known_now(conds: list[Condition]) -> list[Condition]:
    """The conditions of what the snapshots say now: not a rank's that no collector ever
    owned, which counts from when the fleet state first saw it so (its own history)."""
    return [c for c in conds if c.kind != "dp_rank_uncovered" or "collector" in dict(c.labels)]


def test_views_equal_a_fresh_fleet_states_as_the_last_view_is_reused() -> None:
    # FleetState keeps the last view's ownership and scheduler join while the collectors say
    # the same: each view equals that of a fleet state fed the same snapshots afresh.
    now = 5000.0
    fs = FleetState()
    held: dict[str, tuple[Snapshot, float]] = {}

    def send(snap: Snapshot, at: float) -> None:
        fs.update(snap, at)
        held[snap.collector.collector_id] = (snap, at)

    def same(t: float) -> None:
        fresh = FleetState()
        for snap, at in held.values():
            fresh.update(snap, at)
        for _ in range(2):  # the second view from what the first one kept
            assert _seen(fs.view(t)) == _seen(fresh.view(t))
        assert _known_now(fs.conditions(t)) == _known_now(fresh.conditions(t))

    for c in range(6):
        send(scale.synthetic_snapshot(c, 4, 1, now), now)
    same(now)
    send(scale.synthetic_snapshot(2, 4, 2, now + 1), now + 1)  # a leader's new entries
    same(now + 1)
    snap = scale.synthetic_snapshot(3, 4, 2, now + 1)  # a collector owns one rank fewer
    snap.workers[0].ranks_owned = snap.workers[0].ranks_owned[1:]
    send(snap, now + 1)
    same(now + 1)
    for c in (1, 2, 3, 4, 5):  # node-000 goes stale: its ranks have a last owner
        send(scale.synthetic_snapshot(c, 4, 3, now + 5), now + 5)
    same(now + 5)
    snap = scale.synthetic_snapshot(5, 4, 4, now + 5)  # node-005 reads a rank node-004 reads
    snap.scheduler = [
        msgspec.structs.replace(
            scale.synthetic_snapshot(4, 4, 4, now + 5).scheduler[5], source="load"
        )
    ]
    send(snap, now + 5)
    same(now + 5)
    send(scale.synthetic_snapshot(5, 4, 5, now + 6), now + 6)  # read once again
    same(now + 6)
    snap = scale.synthetic_snapshot(4, 4, 5, now + 6)  # the same ranks from other sources
    snap.scheduler = [msgspec.structs.replace(s, source="metrics+load") for s in snap.scheduler]
    send(snap, now + 6)
    same(now + 6)
    moved = scale.synthetic_snapshot(4, 4, 6, now + 6)  # node-005 reads what node-004 did:
    snap = scale.synthetic_snapshot(5, 4, 7, now + 6)  # the same ranks in the same order,
    snap.scheduler, moved.scheduler = moved.scheduler, []  # the unowned ones under node-005
    send(moved, now + 6)
    send(snap, now + 6)
    same(now + 6)
    send(scale.synthetic_snapshot(0, 4, 8, now + 6), now + 6)  # node-000 is back
    same(now + 6)
