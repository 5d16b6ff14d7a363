"""The cache-analytics and router-drift samples: one writer for both renderers.

export/samples.py (reference) and export/chunks.py (cached) both call `collector_samples` per
collector, into their sink or into a TextFamilies of the collector's own (so the bytes agree by
construction), and `fleet_samples` once per scrape with the per-worker sums merged in collector
order. docs/cache-analytics.md says what each family means.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvobserve.export.exposition import Sink
from kvobserve.wire.snapshot import Histogram

if TYPE_CHECKING:
    from kvobserve.analysis.fleet import CollectorView, FleetView, StreamView
    from kvobserve.export.rollup import WorkerSums

FOLD = "#cache"  # key of a stream folded into the per-worker sums, in a sink's seen-set
RESTORE_GAP = "kvobserve_kv_block_restore_gap_seconds"
REPLICATED_CAP = 8  # blocks on this many ranks or more share one `ranks` label value ("8+")
TRUST = "kvobserve_kv_view_trust_ranks"
# family -> label names besides worker_id, of the summed series
_SUMMED = {
    TRUST: ("trust",),
    "kvobserve_kv_blocks_restored_total": ("medium",),
    "kvobserve_kv_restore_untracked_total": (),
    "kvobserve_kv_tier_moves_total": ("from", "to"),
    "kvobserve_kv_tier_unread_blocks": ("medium",),
    "kvobserve_kv_tier_unread_removed_total": ("medium",),
    "kvobserve_kv_lora_blocks": ("medium", "lora_name"),
}
_ONLY_NONZERO = frozenset({TRUST, "kvobserve_kv_restore_untracked_total"})
_DETAIL_ONLY = frozenset(
    {
        "kvobserve_kv_tier_moves_total",
        "kvobserve_kv_tier_unread_blocks",
        "kvobserve_kv_tier_unread_removed_total",
        "kvobserve_kv_lora_blocks",
    }
)
_DRIFT = (
    ("kvobserve_router_index_phantom_blocks", "phantom"),
    ("kvobserve_router_index_missing_blocks", "missing"),
    ("kvobserve_router_index_router_blocks", "router_blocks"),
    ("kvobserve_router_index_engine_blocks", "engine_blocks"),
)


class CacheSums:
    """Per-worker sums of the streams' analytics: values by (family, worker, label values)."""

    __slots__ = ("gaps", "values")

    def __init__(self) -> None:
        self.values: dict[tuple[str, str, tuple[str, ...]], float] = {}
        self.gaps: dict[str, Histogram] = {}  # worker -> restore gaps, cumulative

    def __bool__(self) -> bool:
        return bool(self.values or self.gaps)

    def add(self, name: str, worker_id: str, lv: tuple[str, ...], v: float) -> None:
        """Add one stream's value."""
        key = (name, worker_id, lv)
        self.values[key] = self.values.get(key, 0) + v

    def gap(self, worker_id: str, h: Histogram) -> None:
        """Add one stream and tier's restore-gap histogram (another version's bounds: skipped)."""
        acc = self.gaps.get(worker_id)
        if acc is None:
            self.gaps[worker_id] = Histogram(list(h.bounds), list(h.counts), h.count, h.sum)
        elif acc.bounds == h.bounds and len(h.counts) == len(acc.counts):
            acc.counts = [a + b for a, b in zip(acc.counts, h.counts, strict=True)]
            acc.count += h.count
            acc.sum += h.sum

    def merge(self, other: CacheSums) -> None:
        """Add another collector's sums (in collector order)."""
        for key, v in other.values.items():
            self.values[key] = self.values.get(key, 0) + v
        for w, h in other.gaps.items():
            self.gap(w, h)


def _fold(s: StreamView, sums: CacheSums, detail: bool) -> None:
    """One stream's share of the per-worker sums (gauges only while it is up)."""
    st = s.stats
    w = st.worker_id
    up = s.live and st.up  # StreamView.up, without a property call per stream
    if up and st.trust:
        sums.add(TRUST, w, (st.trust,), 1)
    if st.restore_refused:
        sums.add("kvobserve_kv_restore_untracked_total", w, (), st.restore_refused)
    for m in st.media:
        sums.add("kvobserve_kv_blocks_restored_total", w, (m.medium,), m.restored_total)
        if not detail:
            continue
        if m.restore_gap is not None:
            sums.gap(w, m.restore_gap)
        for src, n in sorted(m.moved_in.items()):
            sums.add("kvobserve_kv_tier_moves_total", w, (src, m.medium), n)
        if m.unread_removed_total or m.unread_blocks:
            sums.add(
                "kvobserve_kv_tier_unread_removed_total", w, (m.medium,), m.unread_removed_total
            )
            if up:
                sums.add("kvobserve_kv_tier_unread_blocks", w, (m.medium,), m.unread_blocks)
        if up:
            for name, n in sorted(m.lora_blocks.items()):
                sums.add("kvobserve_kv_lora_blocks", w, (m.medium, name), n)


def collector_samples(
    f: Sink,
    c: CollectorView,
    streams: list[StreamView],
    sums: WorkerSums,
    detail: bool,
    shard: str = "",
) -> None:
    """One collector's per-stream evidence, drift and drift sources; its streams' shares of the
    per-worker sums go to `sums.cache` (a stream another collector claimed first: skipped).
    `detail`: the opt-in families too; `shard`: the label of per-collector series."""
    node = str(c.info.node_rank)
    for s in streams:
        st = s.stats
        lb = {"worker_id": st.worker_id, "node_rank": node, "dp_rank": str(st.dp_rank)}
        for reason, n in sorted(st.silent_loss.items()):
            if n:
                f.add("kvobserve_kv_silent_loss_evidence_total", {**lb, "reason": reason}, n)
        if s.live and st.up and s.over_capacity:
            f.add("kvobserve_kv_resident_over_capacity", lb, 1)
        if f.fresh((FOLD, st.worker_id, node, lb["dp_rank"])):
            _fold(s, sums.cache, detail)
    if not c.up:
        return
    drift = c.snapshot.drift
    down = {(s.stats.worker_id, s.stats.dp_rank) for s in streams if not s.up} if drift else ()
    for d in drift:
        if (d.worker_id, d.dp_rank) in down:
            continue  # a down stream's index no longer follows the engine: nothing to compare
        lb = {
            "worker_id": d.worker_id,
            "node_rank": node,
            "dp_rank": str(d.dp_rank),
            "medium": d.medium,
            "method": d.method,
        }
        for name, attr in _DRIFT:
            f.add(name, lb, getattr(d, attr))
        if d.jaccard is not None:
            f.add("kvobserve_router_index_jaccard", lb, d.jaccard)
    for src in c.snapshot.drift_sources:
        cl = {"collector": c.info.collector_id, "worker_id": src.worker_id}
        if shard:
            cl["shard"] = shard
        for result, n in sorted(src.comparisons.items()):
            f.add("kvobserve_collector_router_index_comparisons_total", {**cl, "result": result}, n)
        if src.last_ok > 0:
            f.add(
                "kvobserve_collector_router_index_last_success_timestamp_seconds", cl, src.last_ok
            )


def fleet_samples(f: Sink, v: FleetView, sums: CacheSums, detail: bool) -> None:
    """The per-worker series: summed analytics and placement."""
    for (name, w, lv), n in sorted(sums.values.items()):
        if name in _ONLY_NONZERO and not n:
            continue
        if name in _DETAIL_ONLY and not detail:
            continue
        f.add(name, {"worker_id": w, **dict(zip(_SUMMED[name], lv, strict=True))}, n)
    if detail:
        for w, h in sorted(sums.gaps.items()):
            f.histogram(RESTORE_GAP, {"worker_id": w}, h)
    for w, p in v.placement.items():
        lb = {"worker_id": w}
        ratio = p.redundancy
        if ratio is not None:
            f.add("kvobserve_worker_kv_redundancy_ratio", lb, ratio)
        f.add("kvobserve_worker_kv_recomputed_elsewhere_total", lb, p.recomputed_elsewhere)
        if not detail:
            continue
        f.add("kvobserve_worker_kv_blocks_distinct", lb, p.blocks_distinct)
        replicated: dict[str, float] = {}
        for m, n in sorted(p.replicated.items()):
            key = str(m) if m < REPLICATED_CAP else f"{REPLICATED_CAP}+"
            replicated[key] = replicated.get(key, 0.0) + n
        for key, n in replicated.items():
            f.add("kvobserve_worker_kv_blocks_replicated", {**lb, "ranks": key}, n)
        f.add("kvobserve_worker_kv_placement_relative_error", lb, p.relative_error)
