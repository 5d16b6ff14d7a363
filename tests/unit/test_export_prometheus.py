"""FleetCollector: exact values of every family from a rich fleet; stale streams; passthrough."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.parser import text_string_to_metric_families

from kvobserve import __version__
from kvobserve.analysis.fleet import FleetState
from kvobserve.analysis.views import FleetView
from kvobserve.export.catalog import CATALOG, EVENT_TYPES
from kvobserve.export.prometheus import FleetCollector, aggregator_metrics, catalog_metric
from kvobserve.wire.snapshot import (
    CollectorInfo,
    Histogram,
    MediumStats,
    Snapshot,
    StreamStats,
    WorkerInfo,
)
from tests.unit.test_export_fleet import NOW, rich_state, rich_view

S0 = {"worker_id": "sglang-a", "node_rank": "0", "dp_rank": "0"}
S3 = {"worker_id": "sglang-a", "node_rank": "2", "dp_rank": "3"}  # the stale collector's stream


@pytest.fixture(scope="module")
def reg() -> CollectorRegistry:
    r = CollectorRegistry()
    view = rich_view()
    r.register(FleetCollector(lambda: view))
    return r


@pytest.fixture(scope="module")
def detailed() -> CollectorRegistry:
    """The rich fleet with per-stream counters and histograms (the opt-in)."""
    r = CollectorRegistry()
    view = rich_view()
    r.register(FleetCollector(lambda: view, per_stream_detail=True))
    return r


def val(reg: CollectorRegistry, name: str, **labels: str | int) -> float | None:
    return reg.get_sample_value(name, {k: str(v) for k, v in labels.items()})


def test_stream_series_of_a_live_stream(reg: CollectorRegistry) -> None:
    info = {**S0, "engine": "sglang", "endpoint": "tcp://10.0.0.5:5557", "topic": "kv-events"}
    assert val(reg, "kvobserve_stream_info", **info, collector="node-0") == 1
    expected = {
        "kvobserve_stream_up": 1,
        "kvobserve_kv_event_batches_total": 100,
        "kvobserve_kv_sequence_gaps_total": 2,
        "kvobserve_kv_batches_missed_total": 5,
        "kvobserve_kv_batches_recovered_total": 3,
        "kvobserve_kv_batches_lost_total": 2,
        "kvobserve_kv_publisher_restarts_total": 1,
        "kvobserve_kv_duplicate_batches_total": 2,
        "kvobserve_kv_duplicate_stream": 1,
        "kvobserve_kv_rank_mismatch_batches_total": 1,
        "kvobserve_kv_state_complete": 0,
        "kvobserve_kv_last_batch_timestamp_seconds": 1999.5,
        "kvobserve_kv_event_lag_seconds": 0.25,
        "kvobserve_kv_capacity_tokens": 640,  # from the leader's scheduler metrics
        "kvobserve_kv_cache_usage_ratio": 160 / 640,  # GPU tier only, CPU tokens excluded
        "kvobserve_scheduler_running_requests": 3,
        "kvobserve_scheduler_queued_requests": 1,
        "kvobserve_scheduler_token_usage_ratio": 0.3,
        "kvobserve_scheduler_cache_hit_ratio": 0.5,
        "kvobserve_scheduler_max_total_tokens": 640,
    }
    got = {name: val(reg, name, **S0) for name in expected}
    assert got == expected
    assert val(reg, "kvobserve_kv_events_total", **S0, type="stored") is None  # per worker
    assert val(reg, "kvobserve_kv_replay_requests_total", **S0, result="timeout") == 1
    assert val(reg, "kvobserve_kv_decode_errors_total", **S0, reason="msgpack") == 3


def test_block_series_by_medium(reg: CollectorRegistry, detailed: CollectorRegistry) -> None:
    gpu, cpu = {**S0, "medium": "GPU"}, {**S0, "medium": "CPU"}
    for r in (reg, detailed):
        assert [val(r, "kvobserve_kv_blocks", **m) for m in (gpu, cpu)] == [10, 4]
        assert [val(r, "kvobserve_kv_tokens", **m) for m in (gpu, cpu)] == [160, 64]
    r = detailed
    assert [val(r, "kvobserve_kv_blocks_stored_total", **m) for m in (gpu, cpu)] == [50, 6]
    assert [val(r, "kvobserve_kv_blocks_removed_total", **m) for m in (gpu, cpu)] == [40, 2]
    for typ, n in (("stored", 80), ("removed", 15), ("cleared", 5)):
        assert val(r, "kvobserve_kv_events_total", **S0, type=typ) == n
    h = "kvobserve_kv_block_lifetime_seconds"
    buckets = [val(r, f"{h}_bucket", **gpu, le=le) for le in ("1.0", "10.0", "+Inf")]
    assert buckets == [3, 7, 9]
    assert val(r, f"{h}_count", **gpu) == 9
    assert val(r, f"{h}_sum", **gpu) == 42.5
    assert val(r, f"{h}_count", **cpu) is None  # no histogram for CPU in the snapshot
    assert val(reg, f"{h}_count", **gpu) is None  # by default: per worker


def test_worker_sums_by_default(reg: CollectorRegistry) -> None:
    # sglang-a: node-0 ranks 0 and 1, node-1 ranks 1 and 2, the stale node-2's rank 3.
    w = {"worker_id": "sglang-a"}
    got = [val(reg, "kvobserve_kv_events_total", **w, type=t) for t in EVENT_TYPES]
    assert got == [80 + 40 + 10 + 20 + 45, 15 + 5, 5]
    assert val(reg, "kvobserve_kv_events_total", worker_id="vllm-b", type="stored") == 7
    stored = [val(reg, "kvobserve_kv_blocks_stored_total", **w, medium=m) for m in ("GPU", "CPU")]
    assert stored == [50 + 8 + 1 + 2 + 9, 6]
    removed = [val(reg, "kvobserve_kv_blocks_removed_total", **w, medium=m) for m in ("GPU", "CPU")]
    assert removed == [40 + 4, 2]
    h, gpu = "kvobserve_kv_block_lifetime_seconds", {**w, "medium": "GPU"}
    buckets = [val(reg, f"{h}_bucket", **gpu, le=le) for le in ("1.0", "10.0", "+Inf")]
    assert buckets == [3 + 1, 7 + 4, 9 + 4]  # node-2 is down; cumulative values still count
    assert val(reg, f"{h}_sum", **gpu) == 42.5 + 8.0
    assert val(reg, f"{h}_count", **w, medium="CPU") is None


def test_a_repeated_stream_is_summed_once() -> None:
    # node-1 claims node_rank 0 too: its copy of rank 1 is the same stream as node-0's.
    state = rich_state()
    state.snapshot("node-1").collector.node_rank = 0
    view = state.view(NOW)
    r = CollectorRegistry()
    r.register(FleetCollector(lambda: view))
    got = r.get_sample_value(
        "kvobserve_kv_events_total", {"worker_id": "sglang-a", "type": "stored"}
    )
    assert got == 80 + 40 + 20 + 45  # node-1's rank 1 (10) lost the clash; its rank 2 counts


def test_restore_gaps_are_summed_over_every_tier_of_a_rank() -> None:
    """A worker's restore-gap histogram sums every tier of each rank (a summed row whose labels
    do not name the tier: the first copy of a series is per tier, not per stream), as the cached
    text sums them too."""
    gap = Histogram([1.0, 10.0], [2, 3], 6, 20.0)
    media = [MediumStats(m, 4, 64, restore_gap=gap) for m in ("GPU", "CPU_PINNED")]
    snap = Snapshot(
        CollectorInfo("node-0", 0, "gpu-0", 1.0),
        seq=1,
        time=NOW,
        workers=[WorkerInfo("w", "sglang", 1, [0])],
        streams=[StreamStats("w", 0, up=True, media=media)],
    )
    state = FleetState()
    state.update(snap, NOW)
    view = state.view(NOW)
    r = CollectorRegistry()
    r.register(FleetCollector(lambda: view, per_stream_detail=True))
    name = "kvobserve_kv_block_restore_gap_seconds"
    assert val(r, f"{name}_count", worker_id="w") == 12
    assert val(r, f"{name}_sum", worker_id="w") == 40.0
    assert val(r, f"{name}_bucket", worker_id="w", le="1.0") == 4


def test_configured_capacity_wins_over_scheduler(reg: CollectorRegistry) -> None:
    v0 = {"worker_id": "vllm-b", "node_rank": "0", "dp_rank": "0"}
    assert val(reg, "kvobserve_kv_capacity_tokens", **v0) == 10000
    assert val(reg, "kvobserve_kv_cache_usage_ratio", **v0) == 1.2
    # more resident than the rank holds: removals were lost (docs/cache-analytics.md)
    assert val(reg, "kvobserve_kv_resident_over_capacity", **v0) == 1


def test_stale_stream_keeps_counters_and_drops_gauges(
    reg: CollectorRegistry, detailed: CollectorRegistry
) -> None:
    assert val(reg, "kvobserve_stream_up", **S3) == 0
    assert val(reg, "kvobserve_kv_event_batches_total", **S3) == 50
    assert val(reg, "kvobserve_kv_batches_lost_total", **S3) == 4
    assert val(detailed, "kvobserve_kv_blocks_stored_total", **S3, medium="GPU") == 9
    assert val(detailed, "kvobserve_kv_block_lifetime_seconds_count", **S3, medium="GPU") == 4
    info = {**S3, "engine": "sglang", "endpoint": "tcp://10.0.0.7:5560", "topic": "kv-events"}
    assert val(reg, "kvobserve_stream_info", **info, collector="node-2") == 1
    # health: when it last delivered (its collector's last word on it)
    assert val(reg, "kvobserve_kv_last_batch_timestamp_seconds", **S3) == 1989.0
    for gauge in (
        "kvobserve_kv_state_complete",
        "kvobserve_kv_duplicate_stream",
        "kvobserve_kv_capacity_tokens",
        "kvobserve_kv_event_lag_seconds",
        "kvobserve_scheduler_running_requests",
    ):
        assert val(reg, gauge, **S3) is None, gauge
    assert val(reg, "kvobserve_kv_blocks", **S3, medium="GPU") is None
    # The stale collector's unexpected stream is not claimed as active either.
    u = {
        "worker_id": "sglang-a",
        "node_rank": "2",
        "dp_rank": "5",
        "endpoint": "tcp://10.0.0.7:5562",
    }
    assert val(reg, "kvobserve_kv_unexpected_stream", **u) is None


def test_fleet_series(reg: CollectorRegistry) -> None:
    owners = [
        val(reg, "kvobserve_dp_rank_owners", worker_id="sglang-a", dp_rank=r) for r in range(4)
    ]
    assert owners == [1, 2, 1, 0]  # rank 1 claimed twice, rank 3's owner is down
    assert val(reg, "kvobserve_dp_rank_owners", worker_id="vllm-b", dp_rank=1) == 1
    assert val(reg, "kvobserve_worker_dp_size", worker_id="sglang-a") == 4
    assert val(reg, "kvobserve_worker_dp_size", worker_id="vllm-b") == 2
    assert val(reg, "kvobserve_worker_leaders", worker_id="sglang-a") == 1
    ups = [
        val(reg, "kvobserve_collector_up", collector=f"node-{i}", node_rank=i, hostname=f"gpu-{i}")
        for i in range(3)
    ]
    assert ups == [1, 1, 0]
    assert val(reg, "kvobserve_collector_snapshot_age_seconds", collector="node-2") == 10
    assert (
        val(reg, "kvobserve_collector_refused_total", collector="node-0", what="medium_events") == 3
    )
    labels = {
        "worker_id": "sglang-a",
        "node_rank": "0",
        "source": "kv_metrics",
        "reason": "pickle_refused",
    }
    assert val(reg, "kvobserve_scheduler_source_errors_total", **labels) == 2
    assert val(reg, "kvobserve_collector_start_time_seconds", collector="node-1") == 1100
    u = {
        "worker_id": "sglang-a",
        "node_rank": "0",
        "dp_rank": "4",
        "endpoint": "tcp://10.0.0.5:5561",
    }
    assert val(reg, "kvobserve_kv_unexpected_stream", **u) == 1
    assert val(reg, "kvobserve_build_info", version=__version__) == 1


def test_passthrough_families(reg: CollectorRegistry) -> None:
    running = [val(reg, "sglang_num_running_reqs", worker_id="sglang-a", dp_rank=r) for r in (0, 2)]
    assert running == [3, 5]  # merged across two collectors into one family
    assert val(reg, "sglang_prompt_tokens_total", worker_id="sglang-a") == 12345
    assert val(reg, "sglang_stale_only") is None  # from the down collector
    assert val(reg, "kvobserve_kv_blocks") is None  # an engine family may not shadow ours
    fams = {f.name: f.type for f in reg.collect()}
    assert fams["sglang_prompt_tokens"] == "counter"
    assert fams["sglang_num_running_reqs"] == "gauge"


def test_duplicate_label_sets_are_emitted_once() -> None:
    # Two collectors that both claim node_rank 0 and watch the same stream.
    state = rich_state()
    snap = state.snapshot("node-1")
    snap.collector.node_rank = 0
    view = state.view(NOW)
    r = CollectorRegistry()
    r.register(FleetCollector(lambda: view))
    text = choose_encoder("")[0](r).decode()
    families = list(text_string_to_metric_families(text))
    for fam in families:
        keys = [(s.name, tuple(sorted(s.labels.items()))) for s in fam.samples]
        assert len(keys) == len(set(keys)), fam.name
    # The first copy (node-0's, 40 batches) wins; node-1's 10 is dropped.
    s1 = {"worker_id": "sglang-a", "node_rank": "0", "dp_rank": "1"}
    assert r.get_sample_value("kvobserve_kv_event_batches_total", s1) == 40


def test_empty_fleet_serves_build_info_only() -> None:
    r = CollectorRegistry()
    r.register(FleetCollector(FleetView))
    names = {f.name for f in r.collect()}
    assert names == {"kvobserve_build_info"}


def test_extra_metrics_and_aggregator_counters() -> None:
    state = FleetState()
    state.snapshots_applied, state.snapshots_ignored = 7, 2
    r = CollectorRegistry()
    r.register(FleetCollector(FleetView, lambda: aggregator_metrics(state, {"msgpack": 4})))
    assert r.get_sample_value("kvobserve_aggregator_snapshots_applied_total") == 7
    assert r.get_sample_value("kvobserve_aggregator_snapshots_ignored_total") == 2
    got = r.get_sample_value(
        "kvobserve_aggregator_snapshot_decode_errors_total", {"reason": "msgpack"}
    )
    assert got == 4
    with pytest.raises(KeyError):
        catalog_metric("kvobserve_not_in_catalog", [])


def test_an_extra_family_cannot_repeat_one_already_served() -> None:
    clash = catalog_metric("kvobserve_build_info", [({"version": "bogus"}, 1)])
    r = CollectorRegistry()
    r.register(FleetCollector(FleetView, lambda: [clash]))
    assert [f.name for f in r.collect()] == ["kvobserve_build_info"]
    assert r.get_sample_value("kvobserve_build_info", {"version": "bogus"}) is None


def test_openmetrics_negotiation(reg: CollectorRegistry) -> None:
    enc, ctype = choose_encoder("application/openmetrics-text; version=1.0.0")
    body = enc(reg).decode()
    assert ctype.startswith("application/openmetrics-text")
    assert body.endswith("# EOF\n")
    assert "# TYPE kvobserve_kv_event_batches counter" in body
    enc, ctype = choose_encoder("text/plain")
    assert ctype.startswith("text/plain; version=0.0.4")
    assert "# EOF" not in enc(reg).decode()


def test_catalog_names_are_unique_and_typed() -> None:
    names = [m.name for m in CATALOG]
    assert len(names) == len(set(names))
    for m in CATALOG:
        assert m.type in ("counter", "gauge", "histogram"), m.name
        assert (m.type == "counter") == m.name.endswith("_total"), m.name
