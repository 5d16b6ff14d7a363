"""A rich, deterministic fleet shared by the export tests (and checks of what it contains)."""

from __future__ import annotations

from kvobserve.analysis.capacity import BINS
from kvobserve.analysis.conditions import active
from kvobserve.analysis.fleet import FleetState
from kvobserve.analysis.views import FleetView
from kvobserve.wire.capacity import RankCurveStats
from kvobserve.wire.misses import REMOVE, STORE, MissDelta, pack_op
from kvobserve.wire.snapshot import (
    BindStats,
    CheckpointStats,
    CollectorCounters,
    CollectorInfo,
    DriftSource,
    DriftStats,
    Family,
    Histogram,
    MediumStats,
    PrefixCounters,
    RelayStats,
    Sample,
    SchedulerStats,
    Snapshot,
    SourceErrors,
    SourceState,
    StreamStats,
    UnexpectedStream,
    WorkerInfo,
    WorkerPlacement,
)

NOW = 2000.0


def _delta(ops: list[tuple[int, int, int]]) -> MissDelta:
    """Pool sglang-a's sampled changes: (ms after NOW - 2, rank, key) stores of its ranks 0, 1."""
    out = bytearray()
    for ms, ri, key in ops:
        pack_op(out, ms, ri, STORE, key)
    return MissDelta("sglang-a", 1, 1, NOW - 2, NOW - 1, [0, 1], bytes(out))


CURVE_POOL = "vllm-d"  # a healthy pool with a trusted capacity curve (node-1's)


def _curve_pool(early: bool) -> dict[str, list]:  # type: ignore[type-arg]
    """Node-1's vllm-d: one rank of 100 blocks (1,600 tokens); early, its counters as the
    aggregator first sees them (the baselines), then 4,200 blocks later: 4,200 sampled stores of
    new blocks, 4,100 of them evicted (their last copies), 1,000 hit blocks, its curve."""
    ops = bytearray()
    n = 0 if early else 4200
    for i in range(n):
        pack_op(ops, 0, 0, STORE, (i + 1) << 20)
    for i in range(n - 100):
        pack_op(ops, 1, 0, REMOVE, (i + 1) << 20)
    restores = [0] * BINS
    restores[40] = 0 if early else 30  # re-stores about 0.5 x C deep
    curve = RankCurveStats(
        CURVE_POOL, 0, 0, 1600, True, 10 if early else 4210, 10 if early else 4210, restores,
        evicted=0 if early else 4100, evicted_tokens=0 if early else 65_600, block_size=16,
    )  # fmt: skip
    return {
        "workers": [WorkerInfo(CURVE_POOL, "vllm", 1, [0], True, 1600, kv_bytes_per_token=2)],
        "streams": [
            StreamStats(
                CURVE_POOL,
                0,
                engine="vllm",
                endpoint="tcp://10.0.0.8:5557",
                up=True,
                batches_total=9,
                events={"stored": 9},
                state_complete=True,
                media=[MediumStats("GPU", 100, 1600, 4210, 4110)],
                trust="complete",
                block_size=16,
            )
        ],
        "misses": [
            MissDelta(
                CURVE_POOL,
                1 if early else 2,
                0,
                NOW - 6 if early else NOW - 2,
                NOW - 5 if early else NOW - 1,
                [0],
                bytes(ops),
            )
        ],
        "prefix": [PrefixCounters(CURVE_POOL, 0, 0.0 if early else 16_000.0, 160.0 + 16 * n)],
        "curves": [curve],
    }


def _node0() -> Snapshot:
    r0 = StreamStats(
        "sglang-a",
        0,
        engine="sglang",
        endpoint="tcp://10.0.0.5:5557",
        topic="kv-events",
        up=True,
        batches_total=100,
        events={"stored": 80, "removed": 15, "cleared": 5},
        block_size=16,
        media=[
            MediumStats(
                "GPU",
                10,
                160,
                50,
                40,
                Histogram([1.0, 10.0], [3, 7], 9, 42.5),
                restored_total=6,
                restore_gap=Histogram([1.0, 10.0], [2, 5], 6, 20.0),
                moved_in={"CPU": 1},
                lora_blocks={"ad\\apter": 3},
            ),
            MediumStats(
                "CPU", 4, 64, 6, 2, moved_in={"GPU": 5}, unread_removed_total=2, unread_blocks=3
            ),
        ],
        trust="partial",
        trust_reason="lost_batches",
        silent_loss={"remove_unknown": 3, "parent_unknown": 1},
        restore_refused=7,
        recomputed_elsewhere=2,
        gaps=2,
        missed=5,
        recovered=3,
        lost=2,
        replay_requests={"ok": 1, "timeout": 1},
        restarts=1,
        duplicate_batches=2,
        duplicate_stream=True,
        rank_mismatch_batches=1,
        decode_errors={"msgpack": 3},
        interleaved_batches=6,
        already_resident=4,
        unknown_removed=9,
        state_complete=False,
        last_batch_ts=1999.5,
        lag_seconds=0.25,
    )
    r1 = StreamStats(
        "sglang-a", 1, engine="sglang", endpoint="tcp://10.0.0.5:5558", topic="kv-events", up=True,
        batches_total=40, events={"stored": 40}, media=[MediumStats("GPU", 8, 128, 8, 0)],
        state_complete=True, vouched=False, vouch_reason="resuming", lower_tokens=96,
        lower_blocks=6,  # restored from a checkpoint, its ring not asked yet: lower bounds
    )  # fmt: skip
    v0 = StreamStats(
        "vllm-b", 0, engine="vllm", endpoint="tcp://10.0.0.6:5557", topic="", up=True,
        batches_total=7, events={"stored": 7}, media=[MediumStats("GPU", 150, 12000, 150, 0)],
        state_complete=True,
    )  # fmt: skip
    v1 = StreamStats(
        "vllm-b", 1, engine="vllm", endpoint="tcp://10.0.0.6:5558", up=False, batches_total=0
    )
    return Snapshot(
        CollectorInfo("node-0", 0, "gpu-0", 1000.0, "prod-a", "0.1.0"),
        seq=5,
        time=NOW - 0.5,
        workers=[
            WorkerInfo(
                "sglang-a", "sglang", 4, [0, 1], True, 0, "watching", "2 of 4 ranks", 1000.0
            ),
            WorkerInfo("vllm-b", "vllm", 2, [0, 1], True, 10000),
        ],
        # down: served as kvobserve_scheduler_source_state; up: not served
        sources=[
            SourceState(
                "sglang-a",
                "metrics",
                "http://10.0.0.5:30000/metrics",
                "down",
                "cannot connect: connection refused",
                NOW - 60,
                3,
            ),
            SourceState("vllm-b", "load", "tcp://10.0.0.6:5565", "up", "receiving", NOW - 60, 9),
        ],
        streams=[r0, r1, v0, v1],
        unexpected=[UnexpectedStream("sglang-a", 4, "tcp://10.0.0.5:5561", 7, True)],
        refused={"medium_events": 3},
        drift=[
            DriftStats("sglang-a", 0, "GPU", "dump", 12, 10, 3, 1, 0, 0.75, True, NOW - 1),
            DriftStats("vllm-b", 0, "GPU", "size", 150, 150),
        ],
        drift_sources=[
            DriftSource("sglang-a", "http://127.0.0.1:9/dump", "dump", {"ok": 4}, NOW - 1)
        ],
        placement=[WorkerPlacement("sglang-a", [0, 1], 18, 15, {2: 3}, 2)],
        # where the misses come from: rank 0 stores two sampled blocks, rank 1 one of them
        misses=[_delta([(0, 0, 5 << 40), (0, 0, 6 << 40), (1, 1, 5 << 40)])],
        prefix=[PrefixCounters("sglang-a", -1, 1600.0, 8000.0)],  # the tokenizer's
        counters=CollectorCounters(12345, 1, 5, {"buffer_full": 2}),
        checkpoint=CheckpointStats(
            "failing",
            "no_space",
            "/var/lib/kvobserve: full",
            NOW - 700,
            written=40,
            errors={"no_space": 12},
        ),
        scheduler_errors=[SourceErrors("sglang-a", "kv_metrics", "pickle_refused", 2)],
        scheduler=[
            SchedulerStats("sglang-a", 0, "metrics", 3, 1, 0.3, 0.5, 640),
            SchedulerStats("sglang-a", 1, "metrics", 0, 0, None, None, 640),
        ],
        passthrough=[
            Family(
                "sglang:num_running_reqs",
                "gauge",
                "Running requests",
                [Sample("sglang:num_running_reqs", {"worker_id": "sglang-a", "dp_rank": "0"}, 3)],
            ),
            Family(
                "sglang:prompt_tokens_total",
                "counter",
                "Prompt tokens",
                [Sample("sglang:prompt_tokens_total", {"worker_id": "sglang-a"}, 12345)],
            ),
            # An engine family must never shadow ours: dropped.
            Family("kvobserve_kv_blocks", "gauge", "", [Sample("kvobserve_kv_blocks", {}, 99)]),
        ],
    )


def _node1(early: bool = False) -> Snapshot:
    # Also claims rank 1 of sglang-a: rank 1 has two owners (and a second stream copy).
    curve = _curve_pool(early)
    streams = [
        StreamStats("sglang-a", r, engine="sglang", endpoint=f"tcp://10.0.0.5:{5557 + r}", up=True,
                    batches_total=10 * r, events={"stored": 10 * r},
                    media=[MediumStats("GPU", r, 16 * r, r, 0)], state_complete=True)
        for r in (1, 2)
    ]  # fmt: skip
    return Snapshot(
        CollectorInfo("node-1", 1, "gpu-1", 1100.0),
        seq=2 if early else 3,
        time=NOW - 5 if early else NOW - 0.2,
        misses=curve["misses"],
        prefix=curve["prefix"],
        curves=curve["curves"],
        workers=[
            *curve["workers"],
            WorkerInfo("sglang-a", "sglang", 4, [1, 2], False),
            # its discovery fails: no stream known (kvobserve_worker_state{state="undiscovered"})
            WorkerInfo(
                "sglang-c",
                "sglang",
                0,
                [],
                False,
                0,
                "undiscovered",
                "connection refused at http://10.0.0.9:30000/server_info",
                NOW - 30,
            ),
        ],
        streams=streams + curve["streams"],
        binds=[  # bind mode with a relay that lost its target 30 s ago
            BindStats(
                "llmd",
                0,
                "tcp://*:5556",
                "kv@{pod}@{model}",
                "connected",
                "2 publisher(s) connected to tcp://*:5556",
                NOW - 100,
                2,
                500,
                {"topic_mismatch": 4},
                "topic 'other' does not fit 'kv@{pod}@{model}'",
                2,
                RelayStats(
                    "tcp://10.0.1.9:5556",
                    "connecting",
                    "disconnected: tcp://10.0.1.9:5556 went away (restarted?)",
                    NOW - 30,
                    480,
                    6,
                    {"no_target": 14},
                    NOW - 30,
                    10_000,
                ),
            )
        ],
        passthrough=[
            Family(
                "sglang:num_running_reqs",
                "gauge",
                "Running requests",
                [Sample("sglang:num_running_reqs", {"worker_id": "sglang-a", "dp_rank": "2"}, 5)],
            )
        ],
    )


def _node2() -> Snapshot:
    # Silent for 10 intervals: down. Owns rank 3, which is therefore uncovered.
    st = StreamStats(
        "sglang-a", 3, engine="sglang", endpoint="tcp://10.0.0.7:5560", topic="kv-events", up=True,
        batches_total=50, events={"stored": 45, "removed": 5}, gaps=1, missed=4, lost=4,
        media=[MediumStats("GPU", 5, 80, 9, 4, Histogram([1.0, 10.0], [1, 4], 4, 8.0),
                           restored_total=2, restore_gap=Histogram([1.0, 10.0], [1, 2], 2, 3.0))],
        state_complete=True, last_batch_ts=1989.0, lag_seconds=0.1, trust="complete",
        silent_loss={"parent_unknown": 2},
    )  # fmt: skip
    return Snapshot(
        CollectorInfo("node-2", 2, "gpu-2", 900.0),
        seq=9,
        time=NOW - 10,
        workers=[  # its layout mismatch is not served: the collector is down
            WorkerInfo("sglang-a", "sglang", 4, [3], False, 0, "layout_mismatch", "nnodes", 900.0)
        ],
        sources=[SourceState("sglang-a", "load", "tcp://10.0.0.7:5568", "down", "silent", 950.0)],
        streams=[st],
        unexpected=[UnexpectedStream("sglang-a", 5, "tcp://10.0.0.7:5562", 1, True)],
        scheduler=[SchedulerStats("sglang-a", 3, "metrics", 9, 9, 0.9, 0.9, 640)],
        passthrough=[
            Family("sglang:stale_only", "gauge", "", [Sample("sglang:stale_only", {}, 1)])
        ],
    )


def rich_state() -> FleetState:
    """Three collectors (one stale), two workers, an unexpected stream, passthrough families."""
    state = FleetState()
    state.update(_node2(), NOW - 10)
    state.update(_node0(), NOW - 0.5)
    state.update(_node1(early=True), NOW - 5)  # the curve pool's baselines
    state.update(_node1(), NOW - 0.2)
    return state


def rich_view() -> FleetView:
    """The rich fleet as of NOW."""
    return rich_state().view(NOW)


def test_rich_fleet_has_what_the_export_tests_rely_on() -> None:
    v = rich_view()
    assert [(c.info.collector_id, c.up) for c in v.collectors] == [
        ("node-0", True),
        ("node-1", True),
        ("node-2", False),
    ]
    assert len(v.owners[("sglang-a", 1)]) == 2
    assert v.owners[("sglang-a", 3)] == []
    kinds = {c.kind for c in active(v)}
    assert {"duplicate_stream", "unexpected_stream", "collector_down", "dp_rank_uncovered"} <= kinds
