"""Scheduler data joined per (worker_id, dp_rank) across collectors, served under the rank's owner.

The leader reads worker-wide sources (here a KvMetrics PULL that hears every rank), node 1 reads
the load PUB of its own ranks: rank 2 arrives from both collectors and must come out once, with
node 1's node_rank, the freshest value per field, its capacity joined to the stream.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvobserve.analysis.fleet import FleetState
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
