"""The JSON documents of /api/v1/*, built from a FleetView (also what the status page renders)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from kvobserve.aggregator import OVERLAP_TIMEOUT_S
from kvobserve.analysis.capacity import WorkerDeltas
from kvobserve.analysis.conditions import (
    DEFAULT_RUNBOOK_URL,
    KINDS,
    Condition,
    active,
    grouped,
    severity_rank,
)
from kvobserve.analysis.hot import merge_top
from kvobserve.analysis.overlap import OverlapAnswer
from kvobserve.analysis.placement import PlacementEstimate
from kvobserve.analysis.views import KINDS as MISS_KINDS
from kvobserve.analysis.views import (
    CapacityCurve,
    CurvePoint,
    FleetView,
    PoolSplit,
    StreamView,
)
from kvobserve.wire.kv_events import BlockHash
from kvobserve.wire.overlap import MAX_HASHES, HashError, parse_hash
from kvobserve.wire.snapshot import RelayStats

Json = dict[str, Any]


def _t(value: float) -> float | None:
    """A wall-clock time, null for 0 (never)."""
    return value or None


def _age(now: float, t: float) -> float | None:
    return round(max(0.0, now - t), 3) if t else None


def stream_json(s: StreamView, now: float = 0.0, token_usage: float | None = None) -> Json:
    """One stream: labels, state and reason, counters, and its gauges (null while it is not up:
    the staleness rule, docs/metrics.md)."""
    st = s.stats
    live = s.live
    if live:
        state, reason, since = st.state or ("up" if st.up else "down"), st.reason, st.state_since
    else:
        state, since = "stale", s.collector_last_seen
        reason = f"collector {s.collector.collector_id} silent; last known: {st.state or '?'}"
    up = s.up
    seen = up and st.vouched  # the index vouches for its blocks, tokens and usage (vouch.py)
    return {
        "worker_id": st.worker_id,
        "node_rank": s.collector.node_rank,
        "dp_rank": st.dp_rank,
        "collector": s.collector.collector_id,
        "engine": st.engine,
        "endpoint": st.endpoint,
        "topic": st.topic,
        "up": up,
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
        "duplicate_stream": st.duplicate_stream if up else None,
        "rank_mismatch_batches": st.rank_mismatch_batches,
        "decode_errors": dict(st.decode_errors),
        "state_complete": st.state_complete if up else None,
        "blocks": {m.medium: m.blocks for m in st.media} if seen else {},
        "tokens": {m.medium: m.tokens for m in st.media} if seen else {},
        "capacity_tokens": s.capacity_tokens if up else None,
        "cache_usage_ratio": s.usage_ratio if seen else None,  # GPU-tier resident / capacity
        # while the index cannot vouch for those (docs/cache-analytics.md): why, since when,
        # and what is certainly resident in the engine's top tier meanwhile
        "vouched": st.vouched if up else None,
        "unvouched": (
            {
                "reason": st.incomplete_reason or st.vouch_reason,
                "since": _t(st.vouched_since),
                "lower_bound": {"tokens": st.lower_tokens, "blocks": st.lower_blocks},
            }
            if up and not st.vouched
            else None
        ),
        "token_usage_ratio": token_usage if up else None,  # the scheduler's: running requests
        # which scheduler sources report this rank (load, metrics, ...); "none": no source does;
        # null while the stream is not up (a dead rank's scheduler values are not served)
        "scheduler_source": (s.scheduler_source or "none") if up else None,
        "last_batch_ts": st.last_batch_ts or None,
        "lag_seconds": st.lag_seconds if up else None,
        "state": state,
        "reason": reason,
        "state_since": _t(since),
        "events_per_s": st.events_per_s if up else None,
        "last_message_time": _t(st.last_message_time),
        "last_message_age_s": _age(now, st.last_message_time),
        "last_gap_time": _t(st.last_gap_time),
        "last_loss_time": _t(st.last_loss_time),
        "last_restart_time": _t(st.last_restart_time),
        "last_duplicate_time": _t(st.last_duplicate_time),
        "last_decode_error_time": _t(st.last_decode_error_time),
        "last_rank_mismatch_time": _t(st.last_rank_mismatch_time),
        "incomplete_reason": (st.incomplete_reason or None) if up else None,
        # docs/cache-analytics.md
        "trust": (st.trust or None) if up else None,
        "trust_reason": (st.trust_reason or None) if up else None,
        "silent_loss": dict(st.silent_loss),
        "over_capacity": s.over_capacity if up else None,
    }


def streams_json(v: FleetView) -> list[Json]:
    """GET /api/v1/streams."""
    usage = {(s.worker_id, s.dp_rank): s.token_usage_ratio for s, _ in v.scheduler}  # live ranks
    return [
        stream_json(s, v.now, usage.get((s.stats.worker_id, s.stats.dp_rank))) for s in v.streams
    ]


def condition_json(c: Condition, runbook_url: str = DEFAULT_RUNBOOK_URL) -> Json:
    """One active condition, with its alert and runbook link (analysis/conditions.py KINDS)."""
    k = KINDS.get(c.kind)
    return {
        "kind": c.kind,
        "severity": c.severity,
        "labels": dict(c.labels),
        "description": c.description,
        "since": _t(c.since),
        "alert": k.alert if k else None,
        "title": k.title if k else c.kind,
        "runbook_url": k.runbook(runbook_url) if k else None,
    }


def alerts_json(v: FleetView, runbook_url: str = DEFAULT_RUNBOOK_URL) -> list[Json]:
    """GET /api/v1/alerts: the causes, most severe first, in the view's order otherwise; each
    with the conditions that follow from it (`consequences`, analysis/conditions.py FOLLOWS:
    what the example Alertmanager config inhibits under it), in the same order."""

    def sev(c: Condition) -> int:
        return severity_rank(c.severity)

    return [
        {
            **condition_json(c, runbook_url),
            "consequences": [condition_json(x, runbook_url) for x in sorted(then, key=sev)],
        }
        for c, then in sorted(grouped(active(v)), key=lambda g: sev(g[0]))
    ]


def every_alert(alerts: Iterable[Json]) -> Iterable[Json]:
    """Each condition of an /api/v1/alerts document, causes and consequences alike (an older
    aggregator's flat list too)."""
    for a in alerts:
        yield a
        yield from a.get("consequences", ())


def events_json(events: Iterable[Json], limit: int = 100) -> list[Json]:
    """GET /api/v1/events: the most recent first, at most `limit`."""
    return sorted(events, key=lambda e: -float(e.get("time", 0.0)))[:limit]


def fleet_json(v: FleetView) -> Json:
    """GET /api/v1/fleet: collectors, workers with rank owners and leaders, unexpected streams,
    scheduler sources, bound endpoints (bind mode) and their relays."""
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
    states: dict[str, list[Json]] = {}  # what each live collector says about the worker
    for wi, info in v.workers:
        if wi.state:  # "": an older collector
            states.setdefault(wi.worker_id, []).append(
                {
                    "collector": info.collector_id,
                    "node_rank": info.node_rank,
                    "state": wi.state,
                    "reason": wi.reason,
                    "since": _t(wi.since),
                    "elsewhere": list(wi.elsewhere),
                }
            )
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
                "states": states.get(w_id, []),
            }
        )
    sources = [
        {
            "collector": c.info.collector_id,
            "node_rank": c.info.node_rank,
            "worker_id": src.worker_id,
            "source": src.source,
            "endpoint": src.endpoint,
            "state": src.state if c.up else "stale",
            "reason": src.reason,
            "since": _t(src.since),
            "messages": src.messages_total,
        }
        for c in v.collectors
        for src in c.snapshot.sources
    ]
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
    binds = [
        {
            "collector": c.info.collector_id,
            "node_rank": c.info.node_rank,
            "worker_id": b.worker_id,
            "dp_rank": b.dp_rank,
            "endpoint": b.endpoint,
            "topic": b.topic,
            "state": b.state if c.up else "stale",
            "reason": b.reason,
            "since": _t(b.since),
            "publishers": b.publishers,
            "messages": b.messages_total,
            "skipped": dict(b.skipped),
            "skip_reason": b.skip_reason,
            "streams": b.streams,
            "relay": None if b.relay is None else _relay_json(b.relay, c.up),
        }
        for c in v.collectors
        for b in c.snapshot.binds
    ]
    return {
        "collectors": collectors,
        "workers": workers,
        "unexpected": unexpected,
        "scheduler_sources": sources,
        "binds": binds,
    }


def _relay_json(r: RelayStats, up: bool) -> Json:
    """A bound endpoint's relay, as /api/v1/fleet gives it."""
    return {
        "target": r.target,
        "state": r.state if up else "stale",
        "reason": r.reason,
        "since": _t(r.since),
        "forwarded": r.forwarded,
        "filtered": r.filtered,
        "dropped": dict(r.dropped),
        "last_drop": _t(r.last_drop_time),
        "queue": r.queue,
    }


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
        if s.up:  # "holding now": a down stream's residency is unknown
            by_worker.setdefault(s.stats.worker_id, []).append(s)
    workers = []
    for w_id in sorted(by_worker.keys() | v.placement.keys()):
        streams = by_worker.get(w_id, [])
        blocks, bound = merge_top(
            (
                (
                    [(b.hash, b.stores, b.holders) for b in s.stats.hot],
                    s.stats.hot_error,
                    s.collector.collector_id,
                )
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


def _r(x: float | None, digits: int = 4) -> float | None:
    return round(x, digits) if x is not None else None


def split_json(p: PoolSplit) -> Json:
    """One pool's miss split: shares since its start (the sample, its bound and trust), misses
    per worker and kind, hits, and the last window's rates (docs/cache-analytics.md)."""
    r = p.recent
    recent: Json | None = None
    if r is not None:
        total = r.total_misses
        looked = total + r.hits if r.hits is not None else None
        recent = {
            "seconds": round(r.seconds, 1),
            "misses": {k: round(n, 1) for k, n in r.misses.items()},
            "hits": _r(r.hits, 1),
            "shares": {k: _r(r.share(k)) for k in MISS_KINDS} if total else None,
            # over the lookups of the window: hits, and what a perfect router (hits +
            # placement) or unlimited capacity (+ capacity) would have made of them
            "hit_rate": _r(r.hits / looked) if r.hits is not None and looked else None,
            "perfect_router_hit_rate": (
                _r((r.hits + r.misses["placement"]) / looked)
                if r.hits is not None and looked
                else None
            ),
            "unlimited_capacity_adds": (
                _r(r.misses["capacity"] / looked) if r.hits is not None and looked else None
            ),
        }
    return {
        "pool": p.pool,
        "shares": {k: round(x, 4) for k, x in p.shares.items()},
        "bound": round(p.bound, 4),
        "sampled": p.sampled,
        "level": p.level,
        "trusted": p.trusted,
        "reasons": list(p.reasons),
        "reason": p.reason,
        "misses": {k: round(n, 1) for k, n in p.misses().items()},
        "workers": [
            {
                "worker_id": w.worker_id,
                "misses": {k: round(n, 1) for k, n in w.misses.items()},
                "hit_tokens": w.hit_tokens,
                "query_tokens": w.query_tokens,
                "block_size": w.block_size or None,
                "hit_blocks": _r(w.hit_blocks, 1),
            }
            for w in p.workers
        ],
        "recent": recent,
        "as_of": p.as_of,  # engine time the merge has applied every collector's changes up to
    }


def misses_json(v: FleetView) -> Json:
    """GET /api/v1/misses: where each pool's misses come from."""
    return {"pools": [split_json(p) for _, p in sorted(v.misses.items())]}


def factor_label(m: float) -> str:
    """A capacity factor as the API and the `factor` label write it: 1, 1.25, +Inf."""
    return "+Inf" if math.isinf(m) else f"{m:g}"


def _point_json(pt: CurvePoint) -> Json:
    return {
        "factor": factor_label(pt.factor),
        "hit_rate": _r(pt.hit_rate),
        "trusted": pt.trusted,
        "rests_on": pt.rests_on,
        "capacity_tokens": _r(pt.capacity_tokens, 0),
        "capacity_bytes": _r(pt.capacity_bytes, 0),
        **({"low": _r(pt.low), "high": _r(pt.high)} if pt.low is not None else {}),
        # the evictions seen and those the point needs, in capacities (its validity)
        **({"evicted": _r(pt.evicted, 3), "needs": pt.needs} if pt.needs is not None else {}),
    }


def _whatif(c: CapacityCurve, tier_tokens: int | None, ranks: int) -> Json | None:
    """What a tier of `tier_tokens` on each of the curve's `ranks` would add (None: not asked,
    or no curve): the curve at 1 + ranks x N / its capacity (the tier model of
    docs/cache-analytics.md: it takes the top tier's evictions and promotes on hit)."""
    if not tier_tokens or c.estimate is None or not c.capacity_tokens:
        return None
    m = 1 + tier_tokens * ranks / c.capacity_tokens
    at, now = c.estimate.at(m), c.estimate.at(1.0)
    adds = at - now if at is not None and now is not None else None
    return {"tokens": tier_tokens, "factor": round(m, 4), "hit_rate": _r(at), "adds": _r(adds)}


def curve_json(c: CapacityCurve, tier_tokens: int | None = None, ranks: int = 1) -> Json:
    """One capacity curve (a pool as one global cache, or a worker or rank as routed)."""
    out: Json = {"scope": c.scope, "pool": c.pool}
    if c.scope != "pool":
        out["worker_id"] = c.worker_id
    if c.scope == "rank":
        out["dp_rank"] = c.dp_rank
    out.update({
        "routing": c.routing,
        "available": c.available,
        "trusted": c.trusted,
        "reasons": list(c.reasons),
        "reason": c.reason,
        "measured": _r(c.measured),
        "lookups": _r(c.lookups, 0),
        "capacity_tokens": _r(c.capacity_tokens, 0),
        "block_size": c.block_size or None,
        "points": [_point_json(p) for p in c.points],
    })  # fmt: skip
    if c.tier is not None:
        t = c.tier
        out["tier"] = {
            "medium": t.medium or None, "onboarded": _r(t.onboarded, 1), "adds": _r(t.adds),
            "hierarchy": _r(t.hierarchy),
            "whatif_tokens": t.whatif_tokens or None, "whatif_adds": _r(t.whatif_adds),
        }  # fmt: skip
    asked = _whatif(c, tier_tokens, ranks)
    if asked is not None:
        out["whatif_tier"] = asked
    return out


def capacity_json(v: FleetView, pool: str | None = None, tier_tokens: int | None = None) -> Json:
    """GET /api/v1/capacity: what more (or less) KV memory would buy each pool, worker and
    rank (docs/cache-analytics.md "What more memory would buy"); `tier_tokens`: what an offload
    tier of that many tokens per rank would add."""
    pools = []
    for name, pc in sorted(v.capacity.items()):
        if pool is not None and name != pool:
            continue
        doc = curve_json(pc.pool, tier_tokens, max(1, len(pc.ranks)))
        doc["workers"] = [
            curve_json(
                w, tier_tokens, len(w.estimate.ranks) if isinstance(w.estimate, WorkerDeltas) else 1
            )
            for w in pc.workers
        ]
        doc["ranks"] = [curve_json(r, tier_tokens) for r in pc.ranks]
        pools.append(doc)
    return {"pools": pools}


def capacity_query(query: Mapping[str, str]) -> tuple[str | None, int | None]:
    """(pool, tier_tokens) of /api/v1/capacity; QueryError names a bad parameter."""
    raw = query.get("tier_tokens")
    tier: int | None = None
    if raw is not None:
        try:
            tier = int(raw)
        except ValueError:
            raise QueryError(f"tier_tokens: {raw!r} is not a whole number of tokens") from None
        if tier <= 0:
            raise QueryError(f"tier_tokens: {raw!r} must be a positive number of tokens")
    return query.get("pool"), tier


MAX_OVERLAP_TIMEOUT_S = 10.0


class QueryError(ValueError):
    """A bad query parameter; the message names it and the value (a 400)."""


def overlap_query(query: Mapping[str, str], all_hashes: list[str]) -> tuple[
    list[BlockHash], str | None, float
]:  # fmt: skip
    """(hashes, pool, timeout_s) of GET /api/v1/overlap?hashes=h1,h2,...[&pool=P][&timeout_s=S];
    `all_hashes`: every `hashes` parameter given (they are joined). QueryError names the problem."""
    if not all_hashes:
        raise QueryError(
            "hashes: required, e.g. ?hashes=h1,h2,h3: a request's block hashes in order, "
            "as `kvobserve tap` prints them"
        )
    items = [x for one in all_hashes for x in one.split(",")]
    if len(items) > MAX_HASHES:
        raise QueryError(f"hashes: {len(items)} given, at most {MAX_HASHES} per request")
    hashes: list[BlockHash] = []
    for i, text in enumerate(items, 1):
        if not text.strip():
            raise QueryError(f"hashes: item {i} of {len(items)} is empty")
        try:
            hashes.append(parse_hash(text))
        except HashError as exc:
            raise QueryError(f"hashes: item {i}: {exc}") from None
    pool = query.get("pool") or None
    raw = query.get("timeout_s")
    timeout = OVERLAP_TIMEOUT_S
    if raw is not None:
        try:
            timeout = float(raw)
        except ValueError:
            timeout = float("nan")
        if not 0 < timeout <= MAX_OVERLAP_TIMEOUT_S:
            raise QueryError(
                f"timeout_s: {raw!r} is not a number in (0, {MAX_OVERLAP_TIMEOUT_S:g}]"
            )
    return hashes, pool, timeout


def overlap_json(a: OverlapAnswer) -> Json:
    """GET /api/v1/overlap: every rank of the pool with the leading blocks of the request it
    holds now (null and the reason when unknown), and the collectors that did not answer."""
    return {
        "pool": a.pool,
        "workers": list(a.workers),
        "hashes": a.hashes,
        "ranks": [
            {
                "worker_id": r.worker_id,
                "node_rank": r.node_rank,
                "dp_rank": r.dp_rank,
                "leading_blocks": r.leading_blocks,
                "collector": r.collector,
                "trust": r.trust,
                "reason": r.reason or None,
            }
            for r in a.ranks
        ],
        "missing": list(a.missing),
    }
