"""What more memory would buy: the capacity curve's error, memory, ingest cost and traffic.

Run: `python -m benchmarks.capacity [--requests N]`. The targets (docs/cache-analytics.md,
"What more memory would buy"): each point within 0.5 pp of a replay at that capacity with every
block tracked and 1.5 pp with the default sampling; at most 64 B per tracked evicted block and
0.5 tracked entries per resident block (default sampling); kvobserve's ingest with the curve at
least 0.95 x without it; NATS bytes at most +5 % over the same traffic without the curve.

`drive` runs the collectors' and the aggregator's parts in-process on the trace fixture (the
simulator's batches through each rank's sequencer, its pool's miss sampler and capacity curve;
a snapshot per collector every `every` batches into a `FleetState`): the same path as
`kvobserve collect` and `aggregate`, without sockets. The tests use it too.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from benchmarks._common import ROOT
from kvobserve.analysis.analytics import AnalyticsOptions, CacheAnalytics
from kvobserve.analysis.capacity import BELOW, FACTORS, CurveOptions, RankCurve
from kvobserve.analysis.fleet import FleetState
from kvobserve.analysis.miss_sample import MissSampler, RankTap
from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.analysis.views import FleetView, PoolCapacity
from kvobserve.simulate.replay import OfflineRun, replay_capacities, replay_offline
from kvobserve.simulate.stream import SimStream
from kvobserve.simulate.trace import TraceRequest, read_trace
from kvobserve.wire.kv_events import KvBatch, decode_payload
from kvobserve.wire.misses import encode_delta
from kvobserve.wire.snapshot import (
    CollectorInfo,
    MediumStats,
    PrefixCounters,
    Snapshot,
    StreamStats,
    WorkerInfo,
    decode_snapshot,
    encode_snapshot,
)

FIXTURE = ROOT / "tests" / "fixtures" / "traces" / "mooncake-conversation.jsonl.gz"
POOL = "trace"
FORMAT = "sglang-0.5.23"
PAGE = 512  # one engine page per trace block
DEFAULT_SHIP_S = 60.0  # CurveOptions.interval_s
EVERY = CurveOptions(level=0, interval_s=DEFAULT_SHIP_S)  # every block tracked
DEFAULT = CurveOptions(interval_s=DEFAULT_SHIP_S)  # the default sample


class _Fan:
    """Several taps on one sequencer (one per configuration driven side by side)."""

    def __init__(self, taps: list[RankTap]) -> None:
        self.taps = taps

    def observe(self, batch: KvBatch) -> None:
        for t in self.taps:
            t.observe(batch)

    def cleared(self, ts: float) -> None:
        for t in self.taps:
            t.cleared(ts)


@dataclass
class Side:
    """One configuration's collectors and aggregator."""

    options: CurveOptions
    below: bool
    state: FleetState = field(default_factory=FleetState)
    samplers: list[MissSampler] = field(default_factory=list)
    curves: list[RankCurve] = field(default_factory=list)
    seq: int = 0
    bytes: int = 0  # encoded snapshots
    delta_bytes: int = 0  # of which the miss split's deltas (without their store counts)
    curve_bytes: int = 0  # of which the curves and the deltas' exact store counts
    shipped: float = -math.inf  # when the curves last shipped (the drive's clock)


@dataclass
class Driven:
    """A trace driven through one or more configurations: each one's fleet and view."""

    run: OfflineRun
    sides: list[Side]
    views: list[FleetView]

    def capacity(self, i: int = 0) -> PoolCapacity:
        """The pool's curves of configuration `i`."""
        return self.views[i].capacity[POOL]


def drive(
    requests: Sequence[TraceRequest],
    *,
    capacity_tokens: int,
    ranks: int = 1,
    collectors: int = 1,
    route: str = "random",
    page_size: int = 512,
    configs: Sequence[tuple[CurveOptions, bool]] = ((CurveOptions(interval_s=1e-9), False),),
    every: int = 50,
    every_s: float = 0.0,
    salt: int = 0,
) -> Driven:
    """Replay `requests` on `ranks` ranks of one pool of capacity `capacity_tokens` each,
    watched by `collectors` collectors (rank r by collector r * collectors // ranks), once per
    configuration (curve options, below C); a snapshot per collector every `every` batches, or
    with `every_s` every so many trace seconds (a collector's interval at 1x; the curves every
    `interval_s` of them); `salt` re-draws the sample (a salted key instead of the engines'
    hash)."""
    seqs = [StreamSequencer(r, replay=False) for r in range(ranks)]
    owner = [r * collectors // ranks for r in range(ranks)]
    sides = [Side(o, b) for o, b in configs]
    taps: list[list[RankTap]] = [[] for _ in range(ranks)]
    for side in sides:
        side.samplers = [MissSampler(POOL, True, salt=salt) for _ in range(collectors)]
        side.curves = [
            RankCurve(side.options, signed=True, capacity_tokens=capacity_tokens,
                      below=side.below, index=seqs[r].index)
            for r in range(ranks)
        ]  # fmt: skip
        for r in range(ranks):
            taps[r].append(side.samplers[owner[r]].tap(r, side.curves[r]))
    for r, sq in enumerate(seqs):
        sq.tap = _Fan(taps[r])
    clock = {"now": 1000.0, "batches": 0, "ts": 0.0}
    streams_of: list[list[int]] = [[r for r in range(ranks) if owner[r] == c]
                                   for c in range(collectors)]  # fmt: skip
    live: list[SimStream] = []  # the ranks' instances: their hit counters as they go

    def ship(until: float) -> None:
        clock["now"] += 1.0
        now = clock["now"]
        hit = query = 0.0
        for st in live:
            hit += st.hit_tokens
            query += st.query_tokens
        for side in sides:
            for c in range(collectors):
                side.seq += 1
                mine = streams_of[c]
                stats = [
                    StreamStats(
                        POOL, r, engine="sglang", up=True, trust="complete",
                        trust_reason="from_start", block_size=page_size,
                        media=[MediumStats("GPU", len(seqs[r].index.top_resident()))],
                    )
                    for r in mine
                ]  # fmt: skip
                delta = side.samplers[c].delta(until)
                due = now - side.shipped >= side.options.interval_s
                curves = [side.curves[r].stats(POOL, r) for r in mine] if due else []
                snap = Snapshot(
                    CollectorInfo(f"node-{c}", c, f"node-{c}", 1.0), seq=side.seq, time=now,
                    workers=[WorkerInfo(POOL, "sglang", ranks, mine, c == 0, capacity_tokens)],
                    streams=stats, misses=[delta], curves=curves,
                    prefix=[PrefixCounters(POOL, -1, hit, query)] if c == 0 else [],
                )  # fmt: skip
                data = encode_snapshot(snap)
                side.bytes += len(data)
                bare = _without_curve(snap)
                side.curve_bytes += len(data) - len(encode_snapshot(bare))
                side.delta_bytes += sum(len(encode_delta(d)) for d in bare.misses)
                side.state.update(decode_snapshot(data), now)
            if now - side.shipped >= side.options.interval_s:
                side.shipped = now
            fb = side.state.misses.feedback(now)
            for s in side.samplers:
                s.follow(fb.levels.get(POOL, s.level))

    def on_batch(rank: int, seq: int, payload: bytes) -> None:
        b = decode_payload("", seq, payload)
        seqs[rank].on_batch(b, payload, 0.0)
        clock["batches"] += 1
        if every_s > 0:
            if b.ts - clock["ts"] >= every_s:
                clock["ts"] = b.ts
                ship(b.ts)
            return
        clock["ts"] = b.ts
        if clock["batches"] % every == 0:
            ship(b.ts)

    def start(instances: list[SimStream]) -> None:
        live.extend(instances)
        first = requests[0].timestamp_ms / 1000.0 if requests else 0.0
        clock["ts"] = first
        ship(first - 1.0)  # before the first batch: every count starts from 0 here

    run = replay_offline(requests, format=FORMAT, ranks=ranks, capacity_tokens=capacity_tokens,
                         page_size=page_size, route=route, on_batch=on_batch,
                         on_start=start)  # fmt: skip
    for side in sides:
        side.shipped = -math.inf  # the last curves go with the last snapshots
    ship(clock["ts"] + 1e3)
    ship(clock["ts"] + 2e3)  # every rank's curve and counter after the last delta
    views = [side.state.view(clock["now"]) for side in sides]
    return Driven(run, sides, views)


def _without_curve(snap: Snapshot) -> Snapshot:
    """The same snapshot as a collector without the curve would send it."""
    import copy

    bare = copy.copy(snap)
    bare.curves = []
    bare.misses = [copy.copy(d) for d in snap.misses]
    for d in bare.misses:
        d.stored = []
    return bare


# --- error per point ---------------------------------------------------------------------------


def _truth(reqs: Sequence[TraceRequest], sizes: list[int]) -> dict[int, float]:
    got = replay_capacities(reqs, sizes, page_size=PAGE)
    return {c: got[c].pages.hits / got[c].pages.lookups for c in sizes}


def one_rank(reqs: Sequence[TraceRequest], blocks: int) -> tuple[Driven, dict[float, float]]:
    """One rank of `blocks` pages, every block tracked and the default sample, against
    replays at each factor."""
    cap = blocks * PAGE
    factors = (*BELOW, 1.0, *FACTORS, 1e6)
    truth = _truth(reqs, [int(m * cap) for m in factors])
    d = drive(reqs, capacity_tokens=cap, every_s=1.0,
              configs=((EVERY, True), (DEFAULT, True)))  # fmt: skip
    return d, {m: truth[int(m * cap)] for m in factors}


def report_one_rank(blocks: int, d: Driven, truth: dict[float, float]) -> float:
    """Print each point's error (pp) for both samplings; the worst of the default one."""
    worst = 0.0
    print(f"one rank of {blocks:,} pages ({blocks * PAGE / 1e6:.2f} M tokens): hit rate at "
          f"C {100 * truth[1.0]:.2f} %, unlimited {100 * truth[1e6]:.2f} %")  # fmt: skip
    for i, name in ((0, "every block"), (1, "default 1/16")):
        w = d.capacity(i).workers[0]
        cells = []
        for p in w.points:
            want = truth[1e6] if math.isinf(p.factor) else truth[p.factor]
            err = 100 * ((p.hit_rate or 0.0) - want)
            if i == 1 and p.factor >= 1:
                worst = max(worst, abs(err))
            band = f" [{100 * p.low:.2f}-{100 * p.high:.2f}]" if p.low is not None else ""
            cells.append(f"x{p.factor:g} {100 * (p.hit_rate or 0):.2f}{band} ({err:+.2f})")
        print(f"  {name:>13}: " + ", ".join(cells))
    return worst


def pool(
    reqs: Sequence[TraceRequest], blocks: int, route: str
) -> tuple[Driven, dict[float, float]]:
    """Four ranks of `blocks` pages over two collectors, the default sample; the pool as one
    cache of m x its memory against replays of one cache that large."""
    cap = blocks * PAGE
    factors = (1.0, 2.0, 4.0, 1e6)
    truth = _truth(reqs, [int(4 * m * cap) for m in factors])
    d = drive(reqs, capacity_tokens=cap, ranks=4, collectors=2, route=route, every_s=1.0,
              configs=((DEFAULT, False),))  # fmt: skip
    return d, {m: truth[int(4 * m * cap)] for m in factors}


def report_pool(route: str, d: Driven, truth: dict[float, float]) -> float:
    """Print the pool's points and errors (pp); the worst."""
    c = d.capacity().pool
    cells, worst = [], 0.0
    for m in (1.0, 2.0, 4.0, math.inf):
        p = c.point(m)
        want = truth[1e6 if math.isinf(m) else m]
        err = 100 * ((p.hit_rate if p is not None and p.hit_rate is not None else 0.0) - want)
        worst = max(worst, abs(err)) if not math.isinf(m) else worst
        cells.append(f"x{m:g} {100 * want:.2f} ({err:+.2f})")
    print(
        f"  pool, {route:>8}: measured {100 * (c.measured or 0):.2f} %; one cache of "
        + ", ".join(cells)
    )
    return worst


# --- memory ---------------------------------------------------------------------------------


def curve_bytes(c: RankCurve) -> tuple[int, int, int]:
    """(bytes of the entries, fixed bytes, entries) of a rank curve's ghost list and what it
    keeps past the horizon: the dict and the key objects, the list of keys in push order, the
    odd sizes, the sample kept; fixed: the tree of epochs, whatever the entries."""
    g = c.ghosts
    of, odd, flat = g._of, g._odd, g._flat
    n = sys.getsizeof(of) + sum(sys.getsizeof(k) for k in of) + sys.getsizeof(flat)
    n += sum(sys.getsizeof(k) for k in set(flat) - of.keys())  # popped keys it keeps alive
    n += sys.getsizeof(odd) + sys.getsizeof(c._odd)
    kept = c._beyond
    n += sys.getsizeof(kept) + sum(sys.getsizeof(k) for k in kept)
    arrays = (g._tree, g._live, g._keys, g._starts)
    fixed = sum(sys.getsizeof(a) + sum(sys.getsizeof(x) for x in a if x > 256) for a in arrays)
    return n, fixed, len(of) + len(kept)


# --- ingest cost ----------------------------------------------------------------------------


def ingest(reqs: Sequence[TraceRequest], blocks: int, rounds: int) -> dict[str, float]:
    """The trace's own batches on one rank decoded and applied in this thread's CPU time, the
    least of `rounds` passes: sequencer, index, analytics and the miss sampler, without and
    with the rank's curve; microseconds per event."""
    payloads: list[tuple[int, bytes]] = []
    replay_offline(reqs, format=FORMAT, capacity_tokens=blocks * PAGE, page_size=PAGE,
                   on_batch=lambda r, seq, p: payloads.append((seq, p)))  # fmt: skip
    events = sum(len(decode_payload("", s, p).events) for s, p in payloads)
    best = {"off": math.inf, "on": math.inf}
    for _ in range(rounds):
        for name in best:
            sq = StreamSequencer(0, replay=False)
            sq.index.analytics = CacheAnalytics(AnalyticsOptions(), sq.trust)
            curve = RankCurve(DEFAULT, signed=True, capacity_tokens=blocks * PAGE,
                              index=sq.index) if name == "on" else None  # fmt: skip
            sq.tap = MissSampler(POOL, True).tap(0, curve)
            t0 = time.thread_time()
            for s, p in payloads:
                sq.on_batch(decode_payload("kv-events", s, p), p, 0.0)
            best[name] = min(best[name], (time.thread_time() - t0) / events * 1e6)
    return best


def main(argv: list[str] | None = None) -> int:
    """Print the benchmark's figures; returns 0."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.capacity", description=__doc__)
    p.add_argument("--requests", type=int, default=0, help="the trace's first N (0: all)")
    p.add_argument("--blocks", type=int, default=8295, help="one rank's pages (512 tokens)")
    p.add_argument("--pool-blocks", type=int, default=2132, help="each of 4 ranks' pages")
    p.add_argument("--rounds", type=int, default=5, help="ingest passes (the least counts)")
    args = p.parse_args(argv)
    reqs = read_trace(str(FIXTURE))
    if args.requests:
        reqs = reqs[: args.requests]
    print(f"conversation trace, {len(reqs):,} requests; pages of {PAGE} tokens; the simulator's "
          "one-cache replays are the truth")  # fmt: skip
    t0 = time.perf_counter()
    d, truth = one_rank(reqs, args.blocks)
    worst = report_one_rank(args.blocks, d, truth)
    pools = [pool(reqs, args.pool_blocks, route) for route in ("random", "kv_aware")]
    print(f"four ranks of {args.pool_blocks:,} pages over two collectors (the default sample):")
    worst_pool = max(report_pool(r, *x) for r, x in zip(("random", "kv_aware"), pools, strict=True))
    print(
        f"  error: one rank (default) worst {worst:.2f} pp above C (target 1.5); "
        f"pool worst {worst_pool:.2f} pp (target 1)"
    )
    c = d.sides[1].curves[0]
    n, fixed, entries = curve_bytes(c)
    resident = len(c.index.top_resident()) if c.index is not None else 0
    print(f"memory (default sample): {entries:,} entries ({len(c.ghosts):,} ghosts, "
          f"{entries - len(c.ghosts):,} kept past the horizon) for {resident:,} resident blocks: "
          f"{entries / max(resident, 1):.2f} per resident block (target 0.5), "
          f"{n / max(entries, 1):.0f} B per entry (target 64) + {fixed / 1024:.0f} KiB fixed "
          "(the epochs' tree)")  # fmt: skip
    nf, fixed_f, ef = curve_bytes(d.sides[0].curves[0])
    print(f"memory (every block): {ef:,} entries, {nf / max(ef, 1):.0f} B per entry + "
          f"{fixed_f / 1024:.0f} KiB fixed")  # fmt: skip
    cost = ingest(reqs[: min(len(reqs), 3000)], args.blocks, args.rounds)
    print(
        f"ingest (in-process CPU per event, the trace's batches, least of {args.rounds}): "
        f"curve off {cost['off']:.2f} us, on {cost['on']:.2f} us: events/s on/off "
        f"{cost['off'] / cost['on']:.3f} (target >= 0.95)"
    )
    side = pools[0][0].sides[0]
    secs = (reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1000 if reqs else 1.0
    print(
        f"traffic (pool of 4, two collectors, 1 s snapshots at 1x, curves every "
        f"{DEFAULT_SHIP_S:g} s): curves and store counts {side.curve_bytes:,} B "
        f"({side.curve_bytes / secs:.1f} B/s) against the miss split's deltas "
        f"{side.delta_bytes:,} B: +{100 * side.curve_bytes / max(side.delta_bytes, 1):.1f} % "
        f"(target +5 %); against these snapshots without them "
        f"+{100 * side.curve_bytes / max(side.bytes - side.curve_bytes, 1):.1f} %"
    )
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
