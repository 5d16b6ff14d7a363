"""What more (or less) KV memory would buy, fleet-wide: every pool's, worker's and rank's curve.

The aggregator side of the capacity curve (docs/cache-analytics.md "What more memory would
buy"). Two sources, both counted since this aggregator first saw them ("since observed": the
engines' hit counters and the collectors' counts are aligned by taking both at one moment):

- per rank, the `RankCurveStats` its collector ships every curve interval (wire/capacity.py;
  the last one is kept), with the engine's hit counter of the rank (vLLM) or of its worker
  (SGLang's tokenizer): the rank's curve as routed (`RankDeltas`), and the worker's
  (`WorkerDeltas`: each rank's memory scaled alike). These hold for the routing that was
  observed: under a cache-aware router a rank with more memory would have drawn other
  requests, so they are never summed into a pool's what-if.
- per pool, the miss split's sampled stream (analysis/miss_fleet.py, its `SampledSplit`'s
  `PoolGhosts`): the pool run as one global cache of `factor` x its ranks' total capacity
  (`PoolDeltas`).

Each point says what it rests on and whether it is trusted: a point m x C only once (m - 1) x C
of evictions were seen since the start, a clear, a reset or a resync (before that its ghosts
are not all known); a rank down or partial, a collector down, lost deltas or too few samples
say so as the miss split does. A pool of an engine whose eviction does not follow recency
(its profile), or of several engines, has no curve: it says why. Pure: the view is passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvobserve.analysis.capacity import BELOW, FACTORS, RankDeltas, WorkerDeltas
from kvobserve.analysis.capacity_pool import PoolDeltas
from kvobserve.analysis.miss_fleet import MissMerge
from kvobserve.analysis.tiers import TOP_MEDIA
from kvobserve.analysis.views import (
    CapacityCurve,
    CurvePoint,
    FleetView,
    PoolCapacity,
    StreamView,
    TierWorth,
)
from kvobserve.engines import PROFILES
from kvobserve.wire.capacity import RankCurveStats
from kvobserve.wire.snapshot import Snapshot, StreamStats, WorkerInfo

ABOVE = (1.0, *FACTORS, math.inf)  # the points of every curve; BELOW where a rank has them
STORELESS_MAX = 0.1  # below C: trusted while the hits no store shows are under this share
MIN_LOOKUPS = 1000  # a curve over fewer lookups (blocks) is not trusted (few_lookups)


@dataclass(slots=True)
class _RankBase:
    """What a rank's counters were when this aggregator first took them."""

    stats: RankCurveStats
    hit_tokens: float | None  # the rank's own counter (None: the engine counts per worker)
    onboarded: float


@dataclass(slots=True)
class _PoolBase:
    hits: float
    misses: tuple[float, float, float]
    depths: dict[int, float]
    evicted: float
    stores: dict[tuple[str, int], int]  # each rank's curve's stores then (exact)


def _minus(a: list[int], b: list[int]) -> tuple[float, ...]:
    return tuple(float(x - (b[i] if i < len(b) else 0)) for i, x in enumerate(a))


def _onboarded(s: StreamView | StreamStats | None) -> tuple[str, float]:
    """(the lower medium, blocks loaded from it into the top tier) of a stream's stats."""
    if s is None:
        return "", 0.0
    medium, n = "", 0.0
    for m in (s.stats if isinstance(s, StreamView) else s).media:
        if m.medium in TOP_MEDIA:
            for src, k in m.moved_in.items():
                if src not in TOP_MEDIA:
                    medium, n = src, n + k
    return medium, n


class CurveMerge:
    """Every rank's last curve data and the baselines of every curve; fed each snapshot."""

    def __init__(self) -> None:
        self.last: dict[tuple[str, int], tuple[str, RankCurveStats]] = {}  # -> (collector, ...)
        self._rank: dict[tuple[str, int], _RankBase] = {}
        self._worker: dict[str, float] = {}  # a worker's hit tokens at its baseline
        self._pool: dict[str, _PoolBase] = {}

    def add(self, snap: Snapshot, misses: MissMerge) -> None:
        """One collector's applied snapshot (after the miss split took it): its ranks'
        curves, when it carries them; the baselines of what was not counted before."""
        cid = snap.collector.collector_id
        streams = {(st.worker_id, st.dp_rank): st for st in snap.streams} if snap.curves else {}
        for c in snap.curves:
            key = (c.worker_id, c.dp_rank)
            self.last[key] = (cid, c)
            hit = misses.prefix.get(key)
            hit_tokens = hit[0] if hit is not None else None
            base = self._rank.get(key)
            if (
                base is None
                or c.stores < base.stats.stores
                or (hit_tokens is not None and base.hit_tokens is not None
                    and hit_tokens < base.hit_tokens)
                or (base.hit_tokens is None and hit_tokens is not None)
            ):  # fmt: skip
                self._rank[key] = _RankBase(c, hit_tokens, _onboarded(streams.get(key))[1])
            whole = misses.prefix.get((c.worker_id, -1))
            if whole is not None:
                had = self._worker.get(c.worker_id)
                if had is None or whole[0] < had:
                    self._worker[c.worker_id] = whole[0]
        for name, pool in misses.pools.items():
            hits = misses.pool_hits(name)
            if hits is None:
                continue
            g = pool.split.ghosts
            weighed = [0.0, 0.0, 0.0]
            for x in pool.split.weighed.values():
                for k in range(3):
                    weighed[k] += x[k]
            stores = dict(pool.split.stored)
            was = self._pool.get(name)
            if (
                was is None
                or hits < was.hits
                or any(weighed[k] < was.misses[k] for k in range(3))
                or any(n < was.stores.get(k, 0) for k, n in stores.items())
            ):  # a new aggregator or engine process: counted again from now (a rank first
                # heard of later counts from its first delta, as its misses do)
                self._pool[name] = _PoolBase(
                    hits, (weighed[0], weighed[1], weighed[2]), dict(g.depths), g.evicted, stores
                )

    def forget(self, collector_id: str) -> None:
        """A collector forgotten by the fleet: the curves only it sent go."""
        for key in [k for k, (cid, _) in self.last.items() if cid == collector_id]:
            del self.last[key]
            self._rank.pop(key, None)

    # --- per rank and worker ----------------------------------------------------------------

    def _deltas(
        self, key: tuple[str, int], st: RankCurveStats, misses: MissMerge,
        stream: StreamView | None, cap: float,
    ) -> tuple[RankDeltas, _RankBase]:  # fmt: skip
        """The rank's data since its baseline (`add` takes it)."""
        hit = misses.prefix.get(key)
        hit_tokens = hit[0] if hit is not None else None
        base = self._rank.get(key)
        if base is None:  # forgotten meanwhile: from now
            base = self._rank[key] = _RankBase(st, hit_tokens, _onboarded(stream)[1])
        b = base.stats
        size = st.block_size or misses.block_size.get(key[0], 0) or 1
        hits = None
        if hit_tokens is not None and base.hit_tokens is not None:
            hits = (hit_tokens - base.hit_tokens) / size
        d = RankDeltas(
            float(st.stores - b.stores), float(st.sampled_stores - b.sampled_stores),
            _minus(st.restores, b.restores), st.beyond - b.beyond, float(st.basis_tokens),
            cap, hits, _minus(st.below, b.below) if st.below else (),
            float(st.walked - b.walked), float(st.walked_sampled - b.walked_sampled),
            float(1 << st.level),
        )  # fmt: skip
        return d, base

    # --- the view -----------------------------------------------------------------------------

    def views(self, v: FleetView, misses: MissMerge) -> dict[str, PoolCapacity]:
        """Every pool's curves as of the view (its streams, capacities, trust, miss split)."""
        ctx = _Ctx(v, misses)
        out: dict[str, PoolCapacity] = {}
        pooled: set[str] = set()
        for name in sorted(misses.pools):
            pooled |= misses.pools[name].workers
            out[name] = self._pool_view(name, ctx)
        for w, engine in sorted(ctx.engines.items()):  # workers no pool holds (an event plane)
            p = PROFILES.get(engine)
            if w not in pooled and p is not None and not p.recency_eviction:
                out[w] = PoolCapacity(
                    CapacityCurve("pool", w, available=False, reason=_not_lru(engine))
                )
        return out

    def _pool_view(self, name: str, ctx: _Ctx) -> PoolCapacity:
        pool = ctx.misses.pools[name]
        kinds = sorted({ctx.engines[w] for w in pool.workers if ctx.engines.get(w)})
        if len(kinds) > 1:
            held = "; ".join(
                f"{e}: {', '.join(sorted(w for w in pool.workers if ctx.engines.get(w) == e))}"
                for e in kinds
            )
            why = (
                f"not available: the pool mixes engines ({held}); a curve is of one engine's cache"
            )
            return PoolCapacity(CapacityCurve("pool", name, available=False, reason=why))
        if kinds and not PROFILES[kinds[0]].recency_eviction:
            return PoolCapacity(
                CapacityCurve("pool", name, available=False, reason=_not_lru(kinds[0]))
            )
        split = ctx.v.misses.get(name)
        codes = list(split.reasons) if split is not None else []
        said = [split.reason] if split is not None and split.reason else []
        workers: list[CapacityCurve] = []
        ranks: list[CapacityCurve] = []
        for w in sorted(pool.workers):
            wc, rcs = self._worker_view(name, w, ctx)
            workers.append(wc)
            ranks.extend(rcs)
        total = 0.0  # every rank the fleet knows of the pool's workers, at its capacity
        for w, r in sorted(ctx.v.owners):
            if w in pool.workers:
                total += self._capacity((w, r), ctx)
        size = next((ctx.misses.block_size[w] for w in sorted(pool.workers)
                     if ctx.misses.block_size.get(w)), 0)  # fmt: skip
        hits = ctx.misses.pool_hits(name)
        base = self._pool.get(name)
        if hits is None or base is None or not total or not size:
            missing = ("the engines' hit counters" if hits is None or base is None else
                       "the ranks' capacity" if not total else "the block size")  # fmt: skip
            wait = CapacityCurve("pool", name, routing="global", reason=f"waiting for {missing}",
                                 reasons=tuple(codes))  # fmt: skip
            return PoolCapacity(wait, tuple(workers), tuple(ranks))
        g = pool.split.ghosts
        weighed = [sum(x[k] for x in pool.split.weighed.values()) for k in range(3)]
        stores = pool.split.stored  # exact, with the sampled changes (wire/misses.py)
        # the exact stores only when every rank of the pool follows its curve
        every = bool(stores) and len(stores) >= sum(1 for k in ctx.v.owners if k[0] in pool.workers)
        est = PoolDeltas(
            hits - base.hits, weighed[0] - base.misses[0], weighed[1] - base.misses[1],
            weighed[2] - base.misses[2],
            {b: x - base.depths.get(b, 0.0) for b, x in g.depths.items()}, total / size,
            float(sum(n - base.stores.get(k, 0) for k, n in stores.items())) if every else None,
        )  # fmt: skip
        evicted = g.evicted - base.evicted if g.evicted >= base.evicted else g.evicted
        lookups = est.lookups
        if lookups < MIN_LOOKUPS:
            codes.append("few_lookups")
            said.append(f"{lookups:,.0f} lookups since observed (< {MIN_LOOKUPS:,})")
        trusted = not codes
        per = {ctx.infos[w].kv_bytes_per_token for w in pool.workers if w in ctx.infos}
        bytes_per = float(per.pop()) if len(per) == 1 else 0.0
        points = []
        for m in ABOVE:
            if math.isinf(m):
                ok = trusted
                rests = f"since observed: {lookups:,.0f} lookups; every block stored before hits"
            else:
                need = (m - 1) * total / size
                ok = trusted and evicted >= need
                rests = (f"one cache of {_tokens(m * total)} tokens: the placement misses and "
                         f"the capacity misses within it; {evicted:,.0f} last copies evicted "
                         f"since observed (needs {need:,.0f})")  # fmt: skip
            turned = evicted * size / total
            valid = (turned, m - 1) if not math.isinf(m) else (None, None)
            points.append(_point(m, est.at(m), ok, rests, total, bytes_per, *valid))
        curve = CapacityCurve(
            "pool", name, routing="global", reason="; ".join(x for x in said if x),
            points=tuple(points), measured=est.hits / lookups if lookups else None,
            lookups=lookups, capacity_tokens=total, block_size=size, trusted=trusted,
            reasons=tuple(dict.fromkeys(codes)), estimate=est,
        )  # fmt: skip
        return PoolCapacity(curve, tuple(workers), tuple(ranks))

    def _capacity(self, key: tuple[str, int], ctx: _Ctx) -> float:
        """A rank's capacity in tokens: configured or its scheduler's, else its curve's basis
        (the most it held); 0 when none is known."""
        s = ctx.streams.get(key)
        if s is not None and s.capacity_tokens:
            return float(s.capacity_tokens)
        got = self.last.get(key)
        return float(got[1].basis_tokens) if got is not None else 0.0

    def _worker_view(
        self, pool: str, w: str, ctx: _Ctx
    ) -> tuple[CapacityCurve, list[CapacityCurve]]:
        """The worker's curve and its ranks'."""
        info = ctx.infos.get(w)
        bytes_per = float(info.kv_bytes_per_token) if info is not None else 0.0
        ranks: list[CapacityCurve] = []
        deltas: list[RankDeltas] = []
        caps: list[float] = []
        turned: list[float] = []  # each rank's evictions since its start, in capacities
        codes: list[str] = []
        medium, onboarded = "", 0.0
        size = ctx.misses.block_size.get(w, 0)
        for key, (_, st) in sorted(self.last.items()):
            if key[0] != w:
                continue
            s = ctx.streams.get(key)
            cap = self._capacity(key, ctx)
            d, base = self._deltas(key, st, ctx.misses, s, cap)
            deltas.append(d)
            caps.append(cap)
            size = size or st.block_size
            med, on = _onboarded(s)
            medium = medium or med
            onboarded += max(0.0, on - base.onboarded)
            mine = []
            if s is None or not s.live:
                mine.append("collector_down")
            elif not s.stats.up or s.stats.trust == "partial":
                mine.append("rank_partial")
            codes += mine
            turned.append(st.evicted_tokens / cap if cap else 0.0)
            ranks.append(self._curve("rank", pool, w, key[1], d, cap, turned[-1], mine,
                                     bytes_per, st.block_size))  # fmt: skip
        if not deltas:
            none = CapacityCurve("worker", pool, w, available=False,
                                 reason="no curve yet: a collector ships them every curve interval")  # fmt: skip
            return none, ranks
        whole = ctx.misses.prefix.get((w, -1))
        base_hits = self._worker.get(w)
        hits: float | None = None
        if whole is not None and base_hits is not None:
            hits = (whole[0] - base_hits) / (size or 1)
        elif all(d.hits is not None for d in deltas):
            hits = sum(d.hits or 0.0 for d in deltas)
        est = WorkerDeltas(hits if hits is not None else 0.0, tuple(deltas))
        tier = None
        tier_tokens = info.tier_tokens if info is not None else 0
        if hits is not None and (medium or tier_tokens):
            lookups = hits + est.stores
            whatif = None
            if tier_tokens and all(caps):
                at, now = est.at(1 + tier_tokens * len(caps) / sum(caps)), est.at(1.0)
                whatif = at - now if at is not None and now is not None else None
            adds = onboarded / lookups if medium and lookups else None
            hierarchy = (hits + onboarded) / lookups if medium and lookups else None
            tier = TierWorth(medium, onboarded, adds, hierarchy, tier_tokens, whatif)
        curve = self._curve("worker", pool, w, None, est if hits is not None else None,
                            sum(caps), min(turned), codes, bytes_per, size, tier)  # fmt: skip
        return curve, ranks

    def _curve(
        self, scope: str, pool: str, w: str, r: int | None,
        est: RankDeltas | WorkerDeltas | None, cap: float, turned: float, codes: list[str],
        bytes_per: float, block_size: int, tier: TierWorth | None = None,
    ) -> CapacityCurve:  # fmt: skip
        """A rank's or worker's curve as routed: its points with what each rests on;
        `turned`: the evictions since the start, a clear or a reset, in capacities."""
        codes = list(codes)
        hits = est.hits if est is not None else None
        if est is None or hits is None:
            why = ("no hit counter of this rank: the engine counts per worker (the worker's "
                   "curve has them)" if scope == "rank" else "no hit counter of every rank yet")  # fmt: skip
            return CapacityCurve(scope, pool, w, r, reason=why, capacity_tokens=cap or None,
                                 block_size=block_size, reasons=tuple(codes), estimate=est)  # fmt: skip
        lookups = hits + est.stores
        said = []
        if lookups < MIN_LOOKUPS:
            codes.append("few_lookups")
            said.append(f"{lookups:,.0f} lookups since observed (< {MIN_LOOKUPS:,})")
        trusted = not codes
        points = []
        if est.walked:
            unseen = max(0.0, hits - est.walked) / hits if hits else 0.0
            rests = (
                f"{est.walked:,.0f} hits on the paths of requests that stored; "
                f"{unseen:.1%} of the hits in requests that stored nothing (the band)"
            )
            for m in BELOW:
                got = est.below_at(m)
                ok = trusted and turned >= 1 and unseen < STORELESS_MAX
                hr, low, high = got if got is not None else (None, None, None)
                points.append(_point(m, hr, ok, rests, cap, bytes_per, None, None, low, high))
        for m in ABOVE:
            if m == 1:
                ok, rests = trusted, f"the engine's hit counter over {lookups:,.0f} lookups"
            elif math.isinf(m):
                ok = trusted
                rests = (f"since observed: {lookups:,.0f} lookups; blocks evicted past "
                         f"{FACTORS[-1]:g} x C are a sample")  # fmt: skip
            else:
                ok = trusted and turned >= m - 1
                rests = (
                    f"evicted blocks stored again within {m - 1:g} x C; {turned:.2f} x C "
                    f"evicted since the start or a clear (needs {m - 1:g})"
                )
            valid = (turned, m - 1) if 1 < m < math.inf else (None, None)
            points.append(_point(m, est.at(m), ok, rests, cap, bytes_per, *valid))
        return CapacityCurve(
            scope, pool, w, r, routing="observed", reason="; ".join(said),
            points=tuple(points), measured=est.at(1.0), lookups=lookups,
            capacity_tokens=cap or None, block_size=block_size, trusted=trusted,
            reasons=tuple(dict.fromkeys(codes)), tier=tier, estimate=est,
        )  # fmt: skip


@dataclass(slots=True)
class _Ctx:
    """What the curves of one view read: its streams, workers and engines, the miss split."""

    v: FleetView
    misses: MissMerge
    streams: dict[tuple[str, int], StreamView] = field(default_factory=dict)
    engines: dict[str, str] = field(default_factory=dict)
    infos: dict[str, WorkerInfo] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.streams = {(s.stats.worker_id, s.stats.dp_rank): s for s in self.v.streams}
        for w, _ in self.v.workers:
            self.engines.setdefault(w.worker_id, w.engine)
            self.infos.setdefault(w.worker_id, w)
        for s in self.v.streams:
            self.engines.setdefault(s.stats.worker_id, s.stats.engine)


def _not_lru(engine: str) -> str:
    p = PROFILES[engine]
    return (f"not available: {p.title} evicts by {p.eviction}, which its engine profile does "
            "not declare recency-ordered")  # fmt: skip


def _point(
    m: float, hr: float | None, ok: bool, rests: str, cap: float, bytes_per: float,
    evicted: float | None = None, needs: float | None = None,
    low: float | None = None, high: float | None = None,
) -> CurvePoint:  # fmt: skip
    c = None if math.isinf(m) or not cap else m * cap
    return CurvePoint(m, hr, ok, rests, c, c * bytes_per if c and bytes_per else None, low, high,
                      evicted, needs)  # fmt: skip


def _tokens(t: float) -> str:
    return f"{t / 1e6:.3g}M" if t >= 1e6 else f"{t:,.0f}"
