"""The series budget: a realistic fleet serves at most 32 series per stream by default."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvobserve.analysis.blocks import DEFAULT_LIFETIME_BUCKETS
from kvobserve.analysis.fleet import FleetState
from kvobserve.export.catalog import BUDGET, BY_FAMILY, CATALOG, REFERENCE, reference_total
from kvobserve.export.prometheus import FleetCollector
from kvobserve.wire.snapshot import (
    CollectorCounters,
    CollectorInfo,
    Histogram,
    MediumStats,
    SchedulerStats,
    Snapshot,
    StreamStats,
    WorkerInfo,
)

NOW = 5000.0
WORKERS, DP, PER_NODE = 4, REFERENCE["worker"], REFERENCE["collector"]
MEDIA = ("GPU", "CPU_PINNED")


def _snapshot(w: int, node: int) -> Snapshot:
    """Node `node` of worker `w`: PER_NODE ranks, two tiers, replays, decode errors, a leader."""
    worker, first = f"sglang-{w}", node * PER_NODE
    bounds = list(DEFAULT_LIFETIME_BUCKETS)
    streams = [
        StreamStats(
            worker, r, engine="sglang", endpoint=f"tcp://10.0.{w}.{node}:{5557 + r}",
            topic="kv-events", up=True, batches_total=100 + r,
            events={"stored": 90, "removed": 40, "cleared": 1},
            media=[
                MediumStats(m, 10, 160, 50 + r, 40, Histogram(bounds, [i for i in range(15)], 20, 9.5))
                for m in MEDIA
            ],
            gaps=1, missed=2, recovered=2, replay_requests={"ok": 1}, decode_errors={"msgpack": 2},
            state_complete=True, last_batch_ts=NOW - 0.1, lag_seconds=0.01,
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
        seq=1,
        time=NOW,
        workers=[WorkerInfo(worker, "sglang", DP, list(range(first, first + PER_NODE)), node == 0)],
        streams=streams,
        scheduler=sched,
        counters=CollectorCounters(10_000, 0, 100),
    )


def _series(**detail: bool) -> tuple[dict[str, int], int]:
    """(series per family name, streams) of the realistic fleet."""
    state = FleetState()
    for w in range(WORKERS):
        for node in range(DP // PER_NODE):
            state.update(_snapshot(w, node), NOW)
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
    per_stream = sum(n for name, n in counts.items() if name != "kvobserve_build_info") / streams
    assert per_stream <= BUDGET
    assert per_stream == pytest.approx(reference_total())  # docs/metrics.md says so


@pytest.mark.parametrize("detail", [False, True])
def test_each_family_costs_what_the_catalog_says(detail: bool) -> None:
    counts, streams = _series(per_stream_histograms=detail, per_stream_counters=detail)
    for m in CATALOG:
        if m.per == "fleet":
            continue  # the aggregator's own series (build info here), not per stream
        want = m.per_stream(detail) if m.detail else m.per_stream()
        assert counts.get(m.name, 0) / streams == pytest.approx(want), m.name


def test_the_opt_in_restores_per_stream_histograms() -> None:
    default, _ = _series()
    detailed, streams = _series(per_stream_histograms=True)
    hist = "kvobserve_kv_block_lifetime_seconds"
    buckets = len(DEFAULT_LIFETIME_BUCKETS) + 3
    assert detailed[hist] == streams * len(MEDIA) * buckets
    assert default[hist] == WORKERS * len(MEDIA) * buckets
    assert sum(detailed.values()) / streams > BUDGET  # why it is not the default
