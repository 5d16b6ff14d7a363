"""The JSON documents of /api/v1/*, built from a FleetView (also what the status page renders)."""

from __future__ import annotations

from typing import Any

from kvobserve.analysis.fleet import Condition, FleetView, StreamView
from kvobserve.analysis.hot import merge_top
from kvobserve.analysis.placement import PlacementEstimate

Json = dict[str, Any]


def stream_json(s: StreamView) -> Json:
    """One stream: labels, liveness, counters and usage (gauges null when stale)."""
    st = s.stats
    live = s.live
    return {
        "worker_id": st.worker_id,
        "node_rank": s.collector.node_rank,
        "dp_rank": st.dp_rank,
        "collector": s.collector.collector_id,
        "engine": st.engine,
        "endpoint": st.endpoint,
        "topic": st.topic,
        "up": s.up,
        "live": live,
        "batches": st.batches_total,
        "events": dict(st.events),
        "gaps": st.gaps,
        "missed": st.missed,
        "recovered": st.recovered,
        "lost": st.lost,
        "replay_requests": dict(st.replay_requests),
        "restarts": st.restarts,
        "duplicate_batches": st.duplicate_batches,
        "duplicate_stream": st.duplicate_stream if live else None,
        "rank_mismatch_batches": st.rank_mismatch_batches,
        "decode_errors": dict(st.decode_errors),
        "state_complete": st.state_complete if live else None,
        "blocks": {m.medium: m.blocks for m in st.media} if live else {},
        "tokens": {m.medium: m.tokens for m in st.media} if live else {},
        "capacity_tokens": s.capacity_tokens if live else None,
        "usage_ratio": s.usage_ratio if live else None,
        "last_batch_ts": st.last_batch_ts or None,
        "lag_seconds": st.lag_seconds if live else None,
        # docs/cache-analytics.md
        "trust": st.trust or None,
        "trust_reason": st.trust_reason or None,
        "silent_loss": dict(st.silent_loss),
        "over_capacity": s.over_capacity if live else None,
    }


def streams_json(v: FleetView) -> list[Json]:
    """GET /api/v1/streams."""
    return [stream_json(s) for s in v.streams]


def condition_json(c: Condition) -> Json:
    """One active condition."""
    return {
        "kind": c.kind,
        "severity": c.severity,
        "labels": dict(c.labels),
        "description": c.description,
    }


_SEVERITY = {"critical": 0, "warning": 1, "info": 2}


def alerts_json(v: FleetView) -> list[Json]:
    """GET /api/v1/alerts: most severe first, in the view's order otherwise."""
    ordered = sorted(v.conditions, key=lambda c: _SEVERITY.get(c.severity, 9))
    return [condition_json(c) for c in ordered]


def fleet_json(v: FleetView) -> Json:
    """GET /api/v1/fleet: collectors, workers with rank owners and leaders, unexpected streams."""
    collectors = [
        {
            "collector": c.info.collector_id,
            "node_rank": c.info.node_rank,
            "hostname": c.info.hostname,
            "version": c.info.version,
            "up": c.up,
            "age_s": round(c.age_s, 3),
            "workers": [w.worker_id for w in c.snapshot.workers],
        }
        for c in v.collectors
    ]
    workers = []
    for w_id in sorted(v.dp_size.keys() | v.leaders.keys()):
        size = v.dp_size.get(w_id, 0)
        ranks = sorted(r for (w, r) in v.owners if w == w_id)
        workers.append(
            {
                "worker_id": w_id,
                "dp_size": size,
                "leaders": list(v.leaders.get(w_id, [])),
                "owners": {str(r): list(v.owners[(w_id, r)]) for r in ranks},
            }
        )
    unexpected = [
        {
            "worker_id": u.worker_id,
            "node_rank": info.node_rank,
            "dp_rank": u.dp_rank,
            "endpoint": u.endpoint,
            "batches": u.batches_total,
            "active": u.active,
        }
        for u, info in v.unexpected
    ]
    return {"collectors": collectors, "workers": workers, "unexpected": unexpected}


HOT_TOP = 32  # hot prefixes listed per worker


def _hash_str(h: int | bytes) -> str:
    """A block hash as text: decimal for ints (JSON numbers lose 64-bit precision), hex for bytes."""
    return h.hex() if isinstance(h, bytes) else str(h)


def placement_json(p: PlacementEstimate) -> Json:
    """A worker's placement across its ranks (exact, or a sketch estimate with its error)."""
    return {
        "ranks": list(p.ranks),
        "blocks_sum": p.blocks_sum,
        "blocks_distinct": round(p.blocks_distinct, 1),
        "redundancy": round(p.redundancy, 4) if p.redundancy is not None else None,
        "replicated": {str(m): round(n, 1) for m, n in p.replicated.items()},
        "recomputed_elsewhere": p.recomputed_elsewhere,
        "exact": p.exact,
        "relative_error": round(p.relative_error, 4),
    }


def hot_json(v: FleetView, top: int = HOT_TOP) -> Json:
    """GET /api/v1/hot: per worker, the prefixes computed again most often (hashes, never
    tokens) with store counts and the ranks holding them now, and the worker's placement."""
    by_worker: dict[str, list[StreamView]] = {}
    for s in v.streams:
        if s.live:
            by_worker.setdefault(s.stats.worker_id, []).append(s)
    workers = []
    for w_id in sorted(by_worker.keys() | v.placement.keys()):
        streams = by_worker.get(w_id, [])
        blocks, bound = merge_top(
            (
                ([(b.hash, b.stores, b.holders) for b in s.stats.hot], s.stats.hot_error)
                for s in streams
            ),
            top,
        )
        p = v.placement.get(w_id)
        workers.append(
            {
                "worker_id": w_id,
                "error_bound": bound,  # each count may fall short by at most this many stores
                "blocks": [
                    {"hash": _hash_str(h), "stores": n, "stores_max": n + bound, "holders": held}
                    for h, n, held in blocks
                ],
                "placement": placement_json(p) if p is not None else None,
            }
        )
    return {"workers": workers}
