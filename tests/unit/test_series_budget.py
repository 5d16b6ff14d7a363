"""The series budget: a realistic fleet serves at most 32 series per stream by default."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvobserve.analysis.blocks import DEFAULT_LIFETIME_BUCKETS
from kvobserve.analysis.capacity import BINS
from kvobserve.analysis.fleet import FleetState
from kvobserve.analysis.miss_fleet import MissMerge
from kvobserve.analysis.thrash import RESTORE_BUCKETS
from kvobserve.export.catalog import BY_FAMILY, CATALOG
from kvobserve.export.metrics_docs import BUDGET, REFERENCE, per_stream, reference_total
from kvobserve.export.prometheus import FleetCollector
from kvobserve.wire.capacity import RankCurveStats
from kvobserve.wire.misses import REMOVE, STORE, MissDelta, pack_op
from kvobserve.wire.snapshot import (
    CollectorCounters,
    CollectorInfo,
    Histogram,
    MediumStats,
    PrefixCounters,
    SchedulerStats,
    Snapshot,
    StreamStats,
    WorkerInfo,
    WorkerPlacement,
)

NOW = 5000.0
WORKERS, DP, PER_NODE = 4, REFERENCE["worker"], REFERENCE["collector"]
MEDIA = ("GPU", "CPU_PINNED")


def _medium(m: str, r: int) -> MediumStats:
    """A tier with the cache analytics on: restores, moves both ways, unread CPU blocks, LoRA."""
    bounds = list(DEFAULT_LIFETIME_BUCKETS)
    gap = Histogram(
        list(RESTORE_BUCKETS), [min(i, 5) for i in range(len(RESTORE_BUCKETS))], 5, 12.5
    )
    top = m == MEDIA[0]
    return MediumStats(
        m, 10, 160, 50 + r, 40, Histogram(bounds, [i for i in range(15)], 20, 9.5),
        restored_total=5, restore_gap=gap, moved_in={MEDIA[1] if top else MEDIA[0]: 2},
        unread_removed_total=0 if top else 3, unread_blocks=0 if top else 4,
        lora_blocks={"adapter-a": 4} if top else {},
    )  # fmt: skip


def _placement(worker: str, ranks: list[int], node: int) -> WorkerPlacement:
    """Each node's whole top-tier set in its sketch; two keys on both nodes (exact union)."""
    keys = range(node * 3, node * 3 + 5)
    return WorkerPlacement(
        worker, ranks, 80, 70, {2: 10}, 24, sketch_k=1024,
        sketch=b"".join(k.to_bytes(8, "big") for k in keys), sketch_counts=b"\x00\x01" * 5,
    )  # fmt: skip


def _snapshot(w: int, node: int, early: bool = False) -> Snapshot:
    """Node `node` of worker `w`: PER_NODE ranks, two tiers, replays, decode errors, a leader;
    `early`: as the aggregator first saw it (the capacity curves' baselines)."""
    worker, first = f"sglang-{w}", node * PER_NODE
    streams = [
        StreamStats(
            worker, r, engine="sglang", endpoint=f"tcp://10.0.{w}.{node}:{5557 + r}",
            topic="kv-events", up=True, batches_total=100 + r,
            events={"stored": 90, "removed": 40, "cleared": 1},
            media=[_medium(m, r) for m in MEDIA],
            gaps=1, missed=2, recovered=2, replay_requests={"ok": 1}, decode_errors={"msgpack": 2},
            state_complete=True, last_batch_ts=NOW - 0.1, lag_seconds=0.01,
            trust="complete", trust_reason="from_start", recomputed_elsewhere=3, block_size=16,
        )
        for r in range(first, first + PER_NODE)
    ]  # fmt: skip
    sched = [
        SchedulerStats(worker, r, "metrics", 3.0, 1.0, 0.4, 0.6, 500_000.0, NOW)
        for r in range(DP)
        if node == 0
    ]
    return Snapshot(
        CollectorInfo(f"node-{w}-{node}", node, f"gpu-{w}-{node}", NOW - 3600),
        seq=1 if early else 2,
        time=NOW - early,
        workers=[WorkerInfo(worker, "sglang", DP, list(range(first, first + PER_NODE)), node == 0)],
        streams=streams,
        scheduler=sched,
        counters=CollectorCounters(10_000, 0, 100),
        placement=[_placement(worker, list(range(first, first + PER_NODE)), node)],
        # the worker is its own pool: one sampled miss per node, hits from the tokenizer; later
        # the block leaves again (its last copy: at the level the pool reached, enough for
        # the capacity curve's points at 1 and 2 x the pool's memory)
        misses=[
            MissDelta(
                worker,
                1 if early else 2,
                LEVEL,
                NOW - 2,
                NOW - 1,
                [first],
                b"" if early else _store((w * 2 + node + 1) << 16),
            )
        ],
        prefix=[PrefixCounters(worker, -1, 0.0 if early else 1600.0, 8000.0)] if node == 0 else [],
        curves=[_curve(worker, r, early) for r in range(first, first + PER_NODE)],
    )


LEVEL = 30  # each sampled block stands for 2^30: the curve's evictions are then enough


def _curve(worker: str, rank: int, early: bool) -> RankCurveStats:
    """A rank's curve: early its baseline, then 2,000 stores, 7 x its capacity evicted."""
    n = 0 if early else 2000
    return RankCurveStats(worker, rank, 4, 500_000, False, n, n // 16, [0] * BINS,
                          evicted_tokens=0 if early else 3_500_000, block_size=16)  # fmt: skip


def _store(key: int) -> bytes:
    out = bytearray()
    pack_op(out, 0, 0, STORE, key)
    pack_op(out, 1, 0, REMOVE, key)
    return bytes(out)


def _series(**detail: bool) -> tuple[dict[str, int], int]:
    """(series per family name, streams) of the realistic fleet."""
    state = FleetState()
    state.misses = MissMerge(floor=1, start_level=0)  # each pool's split trusted
    for early in (True, False):
        for w in range(WORKERS):
            for node in range(DP // PER_NODE):
                state.update(_snapshot(w, node, early), NOW - early)
    view = state.view(NOW)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FleetCollector(lambda: view, **detail))
    counts: dict[str, int] = {}
    for fam in reg.collect():
        name = BY_FAMILY[fam.name].name
        counts[name] = len({(s.name, tuple(sorted(s.labels.items()))) for s in fam.samples})
    return counts, len(view.streams)


def test_default_series_per_stream_is_within_budget() -> None:
    counts, streams = _series()
    assert streams == WORKERS * DP
    served = sum(n for name, n in counts.items() if name != "kvobserve_build_info") / streams
    assert served <= BUDGET
    assert served == pytest.approx(reference_total())  # docs/metrics.md says so


@pytest.mark.parametrize("detail", [False, True])
def test_each_family_costs_what_the_catalog_says(detail: bool) -> None:
    counts, streams = _series(per_stream_detail=detail)
    for m in CATALOG:
        if m.per == "fleet":
            continue  # the aggregator's own series (build info here), not per stream
        want = per_stream(m, detail) if m.detail or m.detail_only else per_stream(m)
        assert counts.get(m.name, 0) / streams == pytest.approx(want), m.name


def test_per_stream_detail_restores_per_stream_histograms() -> None:
    default, _ = _series()
    detailed, streams = _series(per_stream_detail=True)
    hist = "kvobserve_kv_block_lifetime_seconds"
    buckets = len(DEFAULT_LIFETIME_BUCKETS) + 3
    assert detailed[hist] == streams * len(MEDIA) * buckets
    assert default[hist] == WORKERS * len(MEDIA) * buckets
    assert sum(detailed.values()) / streams > BUDGET  # why it is not the default
