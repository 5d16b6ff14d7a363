"""The JSON documents of /api/v1/*, built from a FleetView (also what the status page renders)."""

from __future__ import annotations

from typing import Any

from kvobserve.analysis.fleet import Condition, FleetView, StreamView

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
        # which scheduler sources report this rank (load, metrics, ...); "none": no source does
        "scheduler_source": (s.scheduler_source or "none") if live else None,
        "last_batch_ts": st.last_batch_ts or None,
        "lag_seconds": st.lag_seconds if live else None,
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
