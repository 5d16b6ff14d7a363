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
from kvobserve.analysis.capacity import CurveOptions, RankCurve
from kvobserve.analysis.fleet import FleetState
from kvobserve.analysis.miss_sample import MissSampler, RankTap
from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.analysis.views import FleetView, PoolCapacity
from kvobserve.simulate.replay import OfflineRun, replay_offline
from kvobserve.simulate.stream import SimStream
from kvobserve.simulate.trace import TraceRequest, read_trace
from kvobserve.wire.kv_events import KvBatch, decode_payload
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
    curve_bytes: int = 0  # of which the curves and the exact store counts


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
    salt: int = 0,
) -> Driven:
    """Replay `requests` on `ranks` ranks of one pool of capacity `capacity_tokens` each,
    watched by `collectors` collectors (rank r by collector r * collectors // ranks), once per
    configuration (curve options, below C); a snapshot per collector every `every` batches;
    `salt` re-draws the sample (a salted key instead of the engines' hash)."""
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
                curves = [side.curves[r].stats(POOL, r) for r in mine]
                snap = Snapshot(
                    CollectorInfo(f"node-{c}", c, f"node-{c}", 1.0), seq=side.seq, time=now,
                    workers=[WorkerInfo(POOL, "sglang", ranks, mine, c == 0, capacity_tokens)],
                    streams=stats, misses=[delta], curves=curves,
                    prefix=[PrefixCounters(POOL, -1, hit, query)] if c == 0 else [],
                )  # fmt: skip
                data = encode_snapshot(snap)
                side.bytes += len(data)
                side.curve_bytes += len(data) - len(encode_snapshot(_without_curve(snap)))
                side.state.update(decode_snapshot(data), now)
            fb = side.state.misses.feedback(now)
            for s in side.samplers:
                s.follow(fb.levels.get(POOL, s.level))

    def on_batch(rank: int, seq: int, payload: bytes) -> None:
        b = decode_payload("", seq, payload)
        seqs[rank].on_batch(b, payload, 0.0)
        clock["batches"] += 1
        clock["ts"] = b.ts
        if clock["batches"] % every == 0:
            ship(b.ts)

    def start(instances: list[SimStream]) -> None:
        live.extend(instances)
        first = requests[0].timestamp_ms / 1000.0 if requests else 0.0
        ship(first - 1.0)  # before the first batch: every count starts from 0 here

    run = replay_offline(requests, format=FORMAT, ranks=ranks, capacity_tokens=capacity_tokens,
                         page_size=page_size, route=route, on_batch=on_batch,
                         on_start=start)  # fmt: skip
    ship(clock["ts"] + 1.0)
    ship(clock["ts"] + 2.0)  # every rank's curve and counter after the last delta
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


def main(argv: list[str] | None = None) -> int:
    """Print the benchmark's figures; returns 0."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.capacity", description=__doc__)
    p.add_argument("--requests", type=int, default=0, help="the trace's first N (0: all)")
    args = p.parse_args(argv)
    reqs = read_trace(str(FIXTURE))
    if args.requests:
        reqs = reqs[: args.requests]
    t0 = time.perf_counter()
    d = drive(reqs, capacity_tokens=8295 * 512)
    print(f"{len(reqs)} requests in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    for pt in d.capacity().workers[0].points:
        print(pt.factor, pt.hit_rate, pt.trusted, pt.rests_on)
    _ = math
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
