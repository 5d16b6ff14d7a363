"""The cache-analytics and drift families: values from the rich fleet (tests/unit/test_export_fleet.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvobserve.export.prometheus import FleetCollector
from tests.unit.test_export_fleet import rich_view


def _reg(detail: bool) -> CollectorRegistry:
    view = rich_view()
    r = CollectorRegistry()
    r.register(FleetCollector(lambda: view, per_stream_detail=detail))
    return r


def test_default_families_sum_per_worker_and_keep_evidence_per_rank() -> None:
    r = _reg(False)
    a0 = {"worker_id": "sglang-a", "node_rank": "0", "dp_rank": "0"}
    ev = "kvobserve_kv_silent_loss_evidence_total"
    assert r.get_sample_value(ev, {**a0, "reason": "remove_unknown"}) == 3
    assert r.get_sample_value(ev, {**a0, "reason": "parent_unknown"}) == 1
    # the stale collector's counter is still true: served
    a3 = {"worker_id": "sglang-a", "node_rank": "2", "dp_rank": "3"}
    assert r.get_sample_value(ev, {**a3, "reason": "parent_unknown"}) == 2
    trust = "kvobserve_kv_view_trust_ranks"
    assert r.get_sample_value(trust, {"worker_id": "sglang-a", "trust": "partial"}) == 1
    assert r.get_sample_value(trust, {"worker_id": "sglang-a", "trust": "complete"}) is None
    restored = "kvobserve_kv_blocks_restored_total"
    assert r.get_sample_value(restored, {"worker_id": "sglang-a", "medium": "GPU"}) == 6 + 2
    assert r.get_sample_value(restored, {"worker_id": "sglang-a", "medium": "CPU"}) == 0
    assert (
        r.get_sample_value("kvobserve_kv_restore_untracked_total", {"worker_id": "sglang-a"}) == 7
    )
    assert (
        r.get_sample_value("kvobserve_kv_restore_untracked_total", {"worker_id": "vllm-b"}) is None
    )
    w = {"worker_id": "sglang-a"}
    # placement within a collector: the opt-in (the miss split has it fleet-wide)
    assert r.get_sample_value("kvobserve_worker_kv_redundancy_ratio", w) is None
    assert r.get_sample_value("kvobserve_worker_kv_recomputed_elsewhere_total", w) is None
    assert (
        r.get_sample_value("kvobserve_kv_tier_moves_total", {**w, "from": "GPU", "to": "CPU"})
        is None
    )


def test_drift_per_rank_and_tier_jaccard_only_for_dump() -> None:
    r = _reg(False)
    d = {
        "worker_id": "sglang-a",
        "node_rank": "0",
        "dp_rank": "0",
        "medium": "GPU",
        "method": "dump",
    }
    assert r.get_sample_value("kvobserve_router_index_phantom_blocks", d) == 3
    assert r.get_sample_value("kvobserve_router_index_missing_blocks", d) == 1
    assert r.get_sample_value("kvobserve_router_index_jaccard", d) == 0.75
    s = {**d, "worker_id": "vllm-b", "method": "size"}
    assert r.get_sample_value("kvobserve_router_index_router_blocks", s) == 150
    assert r.get_sample_value("kvobserve_router_index_jaccard", s) is None
    c = {"collector": "node-0", "worker_id": "sglang-a", "result": "ok"}
    assert r.get_sample_value("kvobserve_collector_router_index_comparisons_total", c) == 4


def test_the_opt_in_serves_tiers_lora_restore_gaps_and_placement() -> None:
    r = _reg(True)
    w = {"worker_id": "sglang-a"}
    assert r.get_sample_value("kvobserve_worker_kv_redundancy_ratio", w) == 18 / 15
    assert r.get_sample_value("kvobserve_worker_kv_recomputed_elsewhere_total", w) == 2
    assert (
        r.get_sample_value("kvobserve_kv_tier_moves_total", {**w, "from": "GPU", "to": "CPU"}) == 5
    )
    assert (
        r.get_sample_value("kvobserve_kv_tier_moves_total", {**w, "from": "CPU", "to": "GPU"}) == 1
    )
    # only the live collector's gauges; the stale one's counters too
    assert r.get_sample_value("kvobserve_kv_tier_unread_blocks", {**w, "medium": "CPU"}) == 3
    assert r.get_sample_value("kvobserve_kv_tier_unread_removed_total", {**w, "medium": "CPU"}) == 2
    lora = {**w, "medium": "GPU", "lora_name": "ad\\apter"}
    assert r.get_sample_value("kvobserve_kv_lora_blocks", lora) == 3
    gap = "kvobserve_kv_block_restore_gap_seconds"
    assert r.get_sample_value(f"{gap}_count", w) == 6 + 2
    assert r.get_sample_value(f"{gap}_bucket", {**w, "le": "1.0"}) == 2 + 1
    assert r.get_sample_value(f"{gap}_sum", w) == 23.0
    assert r.get_sample_value("kvobserve_worker_kv_blocks_distinct", w) == 15
    assert r.get_sample_value("kvobserve_worker_kv_blocks_replicated", {**w, "ranks": "2"}) == 3
    assert r.get_sample_value("kvobserve_worker_kv_placement_relative_error", w) == 0
