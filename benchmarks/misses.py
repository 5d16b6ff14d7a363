"""Where the misses come from, across collectors: the sampled split's error and cost, in one run.

Run: `python -m benchmarks.misses [--trace-seconds 600] [--speed 10] [--route random]
[--salts 20]`. The targets (docs/cache-analytics.md, "Where the misses come from"): each share
within 2 percentage points once a pool has seen 10,000 stores; NATS traffic at most +10 % over
today's snapshots; at most +10 bytes per resident block.

Live, on the wired code: the trace fixture (its first `--trace-seconds` at `--speed`) is
replayed by `kvobserve simulate` on 4 ranks over two loopback nodes (127.0.0.1: ranks 0-1,
127.0.0.2: ranks 2-3); two `kvobserve collect` processes, one per node, publish their snapshots,
each with its sampled deltas of the pool (`Snapshot.misses`), to a real nats-server; this
process runs the aggregator (`Aggregator` over `NatsTransport`, as `kvobserve aggregate` does,
so that its merge can be weighed) and sends the collectors its feedback. Traffic: every
snapshot on the wire weighed with and without its deltas (and the new prefix counters), plus
the feedback messages, as NATS counts a publish; error: each share of the aggregator's split at
the end against the simulator's truth, in the engine's pages and in trace blocks; memory: the
merge's sets and counts per block resident in the pool (the collectors keep nothing per block).

Offline, on the same trace and settings replayed in-process (deterministic): the sample re-drawn
`--salts` times (a salted key instead of the engines' hash), deltas every 10 engine seconds, the
estimate compared with the exact split of the same events when the pool has seen 10,000 and
100,000 stores and at the end: the largest and the RMS error of any share over the draws; and
the exact split's `seen` set, in bytes per distinct block (the within-collector cost).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from benchmarks._common import (
    HOSTS,
    ROOT,
    NatsServer,
    node_collector_toml,
    sim_endpoints,
    spawn_kvobserve,
    stop_process,
)
from kvobserve.aggregator import Aggregator
from kvobserve.analysis.blocks import BlockIndex
from kvobserve.analysis.fleet import FleetState
from kvobserve.analysis.miss_sample import KIND_NAMES, MissSampler, SampledSplit
from kvobserve.analysis.misses import MissCounts, PoolMisses
from kvobserve.simulate.replay import replay_offline
from kvobserve.simulate.trace import read_trace
from kvobserve.transport.nats import NatsTransport
from kvobserve.transport.subjects import misses_subject
from kvobserve.wire.kv_events import decode_payload
from kvobserve.wire.misses import decode_delta, encode_delta
from kvobserve.wire.snapshot import decode_snapshot, encode_snapshot

FIXTURE = ROOT / "tests" / "fixtures" / "traces" / "mooncake-conversation.jsonl.gz"
CLUSTER = "bench"
TARGET_PP, TARGET_TRAFFIC, TARGET_BYTES = 2.0, 0.10, 10.0
CHECKPOINTS = (10_000, 100_000)
ME = "misses-bench"


def shares(c: MissCounts) -> dict[str, float]:
    """Kind -> fraction of the misses."""
    t = c.total or 1
    return {k: getattr(c, k) / t for k in KIND_NAMES}


def truth_counts(pages: dict[str, int]) -> MissCounts:
    """The simulator truth's page misses as counts."""
    return MissCounts(pages["compulsory"], pages["capacity"], pages["placement"])


def worst_pp(est: dict[str, float], ref: dict[str, float]) -> float:
    """The largest error of any share, in percentage points."""
    return max(abs(est[k] - ref[k]) for k in KIND_NAMES) * 100


def split_bytes(s: SampledSplit) -> int:
    """The merge's memory: its sets and the ints they hold, its counters."""
    n = sys.getsizeof(s.seen) + sum(sys.getsizeof(i) for i in s.seen)
    n += sum(sys.getsizeof(r) for r in s.resident.values())  # their ints are in `seen` too
    n += sum(sys.getsizeof(k) * 3 + 3 * 65 * 8 for k in s.counts.values())
    n += sys.getsizeof(s.per_block) + sum(sys.getsizeof(c) for c in s.per_block.values())
    return n


def seen_bytes_per_block(pool: PoolMisses, indexes: list[BlockIndex]) -> float:
    """The exact split's cost: the seen set, plus the hash objects only it keeps alive."""
    resident: set[Any] = set()
    for ix in indexes:
        resident.update(ix.resident_hashes().get("GPU", ()))
    own = sum(sys.getsizeof(h) for h in pool.seen if h not in resident)
    return (sys.getsizeof(pool.seen) + own) / max(len(pool.seen), 1)


# --- offline: the spread over re-drawn samples -------------------------------------------------


@dataclass
class Offline:
    """Errors (pp) per checkpoint over the draws; the exact split's cost."""

    errors: dict[str, list[float]] = field(default_factory=dict)  # checkpoint -> per draw
    bounds: dict[str, list[float]] = field(default_factory=dict)  # the estimate's own, pp
    sampled: dict[str, list[int]] = field(default_factory=dict)
    seen_bytes: float = 0.0
    stores: int = 0


def offline(args: argparse.Namespace) -> Offline:
    """Replay in-process; every draw of the sample against the exact split of the same events."""
    reqs = read_trace(str(FIXTURE), args.trace_seconds)
    rng = random.Random(7)
    salts = [rng.getrandbits(64) | 1 for _ in range(args.salts)]
    samplers = {s: [MissSampler(CLUSTER, True, salt=s) for _ in range(2)] for s in salts}
    merged = {s: SampledSplit() for s in salts}
    indexes = [BlockIndex() for _ in range(4)]
    pool = PoolMisses()
    for r, ix in enumerate(indexes):
        pool.attach(r, ix)
    out = Offline()
    todo = list(CHECKPOINTS)
    due = [10.0]

    def ship(until: float) -> None:
        for s in salts:
            for k, sampler in enumerate(samplers[s]):
                merged[s].add(f"node-{k}", decode_delta(encode_delta(sampler.delta(until))))
            merged[s].advance()
            for sampler in samplers[s]:
                sampler.follow(merged[s].level)

    def measure(name: str) -> None:
        ref = shares(pool.totals())
        for s in salts:
            est = merged[s].estimate()
            out.errors.setdefault(name, []).append(worst_pp(est.shares, ref))
            out.bounds.setdefault(name, []).append(100 * est.bound)
            out.sampled.setdefault(name, []).append(est.sampled)

    def on(rank: int, seq: int, payload: bytes) -> None:
        b = decode_payload("", seq, payload)
        indexes[rank].apply_batch(b)
        for s in salts:
            samplers[s][rank // 2].observe(rank, b)
        if b.ts >= due[0]:
            ship(b.ts)
            due[0] = b.ts + 10.0
        if todo and pool.totals().total >= todo[0]:
            ship(b.ts)
            measure(f"{todo.pop(0):,} stores")

    replay_offline(reqs, ranks=4, capacity_tokens=args.capacity, page_size=args.page_size,
                   route=args.route, on_batch=on)  # fmt: skip
    ship(math.inf)
    out.stores = pool.totals().total
    measure(f"end ({out.stores:,} stores)")
    out.seen_bytes = seen_bytes_per_block(pool, indexes)
    return out


@dataclass
class Whole:
    """The production sample over a whole trace at 1x: what the deltas cost."""

    trace_seconds: float = 0.0
    stores: int = 0
    delta_bytes: int = 0  # as NATS counts a publish: the PUB line, the payload, CRLF
    messages: int = 0
    error_pp: float = 0.0
    bound_pp: float = 0.0
    sampled: int = 0
    merge_bytes: int = 0
    resident_blocks: int = 0
    seen_bytes: float = 0.0


def whole(args: argparse.Namespace) -> Whole:
    """The whole trace in-process, a delta per collector (and the level back) every trace
    second, as at 1x with 1 s snapshots; the estimate against the exact split at the end."""
    reqs = read_trace(str(FIXTURE))
    samplers = [MissSampler(CLUSTER, True) for _ in range(2)]
    merged = SampledSplit()
    indexes = [BlockIndex() for _ in range(4)]
    pool = PoolMisses()
    for r, ix in enumerate(indexes):
        pool.attach(r, ix)
    out = Whole(trace_seconds=(reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1000)
    due = [1.0]

    def publish(subject: str, data: bytes) -> None:
        out.delta_bytes += len(f"PUB {subject} {len(data)}\r\n") + len(data) + 2
        out.messages += 1

    def ship(until: float) -> None:
        for k, sampler in enumerate(samplers):
            data = encode_delta(sampler.delta(until))
            publish(f"kvobserve.v1.{CLUSTER}.misses.node-{k}", data)
            merged.add(f"node-{k}", decode_delta(data))
        merged.advance()
        publish(f"kvobserve.v1.{CLUSTER}.misses_level", str(merged.level).encode())
        for sampler in samplers:
            sampler.follow(merged.level)

    def on(rank: int, seq: int, payload: bytes) -> None:
        b = decode_payload("", seq, payload)
        indexes[rank].apply_batch(b)
        samplers[rank // 2].observe(rank, b)
        while b.ts >= due[0]:  # a delta every trace second, empty ones too
            ship(due[0])
            due[0] += 1.0

    run = replay_offline(reqs, ranks=4, capacity_tokens=args.capacity, page_size=args.page_size,
                         route=args.route, on_batch=on)  # fmt: skip
    ship(math.inf)
    exact = pool.totals()
    est = merged.estimate()
    out.stores, out.sampled, out.bound_pp = exact.total, est.sampled, 100 * est.bound
    out.error_pp = worst_pp(est.shares, shares(exact))
    out.merge_bytes = split_bytes(merged)
    out.resident_blocks = sum(len(s.cache.nodes) for s in run.streams)
    out.seen_bytes = seen_bytes_per_block(pool, indexes)
    return out


# --- live: the simulator, two collectors, NATS, the aggregator's merge ------------------------


@dataclass
class Live:
    """What the live run measured."""

    seconds: float = 0.0
    delta_bytes: int = 0  # the snapshots' `misses` field, as NATS counts a message
    snapshot_bytes: int = 0  # the same snapshots without it: today's
    feedback_bytes: int = 0  # the aggregator's feedback to the collectors
    estimate: dict[str, float] = field(default_factory=dict)
    sampled: int = 0
    bound: float = 0.0
    level: int = 0
    trusted: bool = False
    reason: str = ""
    truth: dict[str, float] = field(default_factory=dict)
    truth_blocks: dict[str, float] = field(default_factory=dict)
    stores: int = 0
    weighed: float = 0.0  # the counters' misses (each sampled miss weighed by 2^level)
    merge_bytes: int = 0
    resident_blocks: int = 0
    late_ops: int = 0


def _wire_size(subject: str, data: bytes) -> int:
    """What a publish costs on the wire: the PUB line, the payload, CRLF."""
    return len(f"PUB {subject} {len(data)}\r\n") + len(data) + 2


async def _observe(args: argparse.Namespace, nats_server: NatsServer, truth_path: Path) -> Live:
    """The aggregator's merge in this process (to weigh its memory), fed over NATS by the two
    `kvobserve collect` processes; every snapshot weighed with and without its deltas."""
    transport = NatsTransport(nats_server.url, CLUSTER, name=ME)
    await transport.connect()
    agg = Aggregator(FleetState())
    await agg.start(transport)
    out = Live()
    nc = transport.client
    assert nc is not None

    async def weigh(msg: Any) -> None:
        snap = decode_snapshot(msg.data)
        if not snap.misses:
            return
        bare = encode_snapshot(msgspec.structs.replace(snap, misses=[], prefix=[]))
        out.snapshot_bytes += _wire_size(msg.subject, bare)
        out.delta_bytes += _wire_size(msg.subject, msg.data) - _wire_size(msg.subject, bare)

    async def feedback(msg: Any) -> None:
        out.feedback_bytes += _wire_size(msg.subject, msg.data)

    await nc.subscribe(f"kvobserve.v1.{CLUSTER}.snapshot.>", cb=weigh)
    await nc.subscribe(misses_subject(CLUSTER), cb=feedback)
    t0 = time.monotonic()
    caught_up: float | None = None
    try:
        while True:
            await asyncio.sleep(0.5)  # polling the truth file and the merge, with a deadline
            if time.monotonic() - t0 > args.timeout:
                raise TimeoutError(f"the replay did not finish in {args.timeout} s")
            doc = _truth(truth_path)
            if not (doc and doc["done"] and doc["pending_events"] == 0):
                continue
            whole = json.loads(truth_path.read_text())
            sent = {int(r): rank["instances"][-1]["batches"]
                    for w in whole["workers"] for r, rank in w["ranks"].items()}  # fmt: skip
            v = agg.view()
            applied = {s.stats.dp_rank: s.stats.batches_total for s in v.streams}
            if applied != sent:
                continue
            caught_up = caught_up or time.time()
            split = v.misses.get(CLUSTER)
            if split is not None and (split.as_of or 0) > caught_up:
                break
        out.seconds = time.monotonic() - t0
        out.estimate, out.sampled, out.bound = split.shares, split.sampled, split.bound
        out.level, out.trusted, out.reason = split.level, split.trusted, split.reason
        out.weighed = sum(split.misses().values())
        pool = agg.fleet.misses.pools[CLUSTER].split
        out.merge_bytes = split_bytes(pool)
        out.late_ops = pool.late_ops
        return out
    finally:
        await agg.stop()
        await transport.close()


def _truth(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    replays: list[dict[str, Any]] = doc.get("replays", [])
    return replays[0] if replays else None


def live(args: argparse.Namespace, workdir: Path) -> Live:
    """The simulator and two collectors as processes, one nats-server; see the module doc."""
    truth_path = workdir / "truth.json"
    procs: list[subprocess.Popen[bytes]] = []
    with NatsServer(workdir / "nats.log") as nats_server:
        try:
            sim = spawn_kvobserve(
                ["simulate", "--trace", str(FIXTURE), "--trace-seconds", str(args.trace_seconds),
                 "--speed", str(args.speed), "--route", args.route, "--dp-size", "4", "--nnodes",
                 "2", "--all-nodes", "--node-hosts", ",".join(HOSTS), "--capacity-tokens",
                 str(args.capacity), "--page-size", str(args.page_size), "--start-delay", "3",
                 "--no-http", "--no-replay", "--worker-id", CLUSTER, "--truth", str(truth_path),
                 "--truth-interval", "1"],
                workdir / "sim.log", pipe=True,
            )  # fmt: skip
            procs.append(sim)
            kv = sim_endpoints(sim)["kv"]
            base = int(kv[0].rsplit(":", 1)[1])
            for node in (0, 1):
                toml = workdir / f"node-{node}.toml"
                cfg = node_collector_toml(toml, CLUSTER, node, 4, nats_server.url, base)
                argv = ["collect", "-c", str(cfg), "--no-local-http"]
                procs.append(spawn_kvobserve(argv, workdir / f"node-{node}.log"))
            out = asyncio.run(_observe(args, nats_server, truth_path))
        finally:
            for p in reversed(procs):
                stop_process(p)
        doc = json.loads(truth_path.read_text())
    replay = doc["replays"][0]
    c = truth_counts(replay["pool"]["pages"])
    out.truth, out.stores = shares(c), c.total
    out.truth_blocks = shares(truth_counts(replay["pool"]["blocks"]))
    out.resident_blocks = sum(
        len(inst["resident"].get("GPU", []))
        for w in doc["workers"]
        for rank in w["ranks"].values()
        for inst in rank["instances"][-1:]
    )
    return out


# --- report ------------------------------------------------------------------------------------


def _pct(d: dict[str, float]) -> str:
    return "  ".join(f"{k} {100 * d[k]:5.2f}%" for k in KIND_NAMES)


def header(args: argparse.Namespace) -> None:
    """What was replayed."""
    print(f"trace: first {args.trace_seconds:g} s of {FIXTURE.name}, 4 ranks over 2 collectors, "
          f"route {args.route}, page {args.page_size}, {args.capacity:,} tokens per rank",
          flush=True)  # fmt: skip


def report_live(args: argparse.Namespace, lv: Live) -> None:
    """The live run against the targets."""
    err = worst_pp(lv.estimate, lv.truth)
    err_blocks = worst_pp(lv.estimate, lv.truth_blocks)
    traffic = lv.delta_bytes + lv.feedback_bytes
    ratio = traffic / lv.snapshot_bytes if lv.snapshot_bytes else math.inf
    per_block = lv.merge_bytes / max(lv.resident_blocks, 1)
    print(f"\nlive at {args.speed:g}x: {lv.seconds:.0f} s, {lv.stores:,} stores (pages); two "
          "`kvobserve collect` processes, the aggregator's merge here")  # fmt: skip
    print(f"  truth (pages)              {_pct(lv.truth)}")
    print(f"  truth (trace blocks)       {_pct(lv.truth_blocks)}")
    print(f"  the aggregator's split     {_pct(lv.estimate)}   n={lv.sampled:,} "
          f"level={lv.level} own bound={100 * lv.bound:.2f} pp, "
          f"{'trusted' if lv.trusted else 'not trusted: ' + lv.reason}")  # fmt: skip
    print(f"  error: {err:.2f} pp against pages, {err_blocks:.2f} pp against trace blocks "
          f"(target <= {TARGET_PP:g}); late ops {lv.late_ops}; the counters' misses "
          f"{lv.weighed:,.0f} against {lv.stores:,} stores "
          f"({100 * (lv.weighed / max(lv.stores, 1) - 1):+.1f}%)")  # fmt: skip
    print(f"  NATS: deltas in the snapshots {lv.delta_bytes:,} B + feedback "
          f"{lv.feedback_bytes:,} B / the same snapshots without them {lv.snapshot_bytes:,} B = "
          f"+{100 * ratio:.1f}% (target <= +{100 * TARGET_TRAFFIC:g}%); at 1x the same deltas "
          f"over {args.speed:g}x the snapshots: +{100 * ratio / args.speed:.1f}%")  # fmt: skip
    print(f"  memory: the merge {lv.merge_bytes:,} B for {lv.resident_blocks:,} resident blocks = "
          f"{per_block:.2f} B/block (target <= {TARGET_BYTES:g}); the collectors keep nothing "
          "per block", flush=True)  # fmt: skip


def report_offline(args: argparse.Namespace, off: Offline) -> None:
    """The spread over the draws of the sample."""
    print(f"\noffline, {args.salts} draws of the sample, against the exact split:")
    for name, errs in off.errors.items():
        rms = math.sqrt(sum(e * e for e in errs) / len(errs))
        n = off.sampled[name]
        within = sum(1 for e in errs if e <= TARGET_PP)
        bounds = off.bounds[name]
        covered = sum(1 for e, b in zip(errs, bounds, strict=True) if e <= b)
        print(f"  at {name:>26}: worst share max {max(errs):5.2f} pp, RMS {rms:5.2f} pp, "
              f"{within}/{len(errs)} within {TARGET_PP:g} pp; own bound {min(bounds):.2f}-"
              f"{max(bounds):.2f} pp, held by {covered}/{len(errs)}; sampled misses "
              f"{min(n):,}-{max(n):,}")  # fmt: skip
    print(f"  exact within a collector: seen set {off.seen_bytes:.0f} B per distinct block",
          flush=True)  # fmt: skip


def report_whole(wh: Whole, lv: Live | None) -> None:
    """The production sample over the whole trace at 1x."""
    print(f"\nthe whole trace ({wh.trace_seconds:,.0f} s) at 1x, in-process, {wh.stores:,} "
          f"stores: error {wh.error_pp:.2f} pp (n={wh.sampled:,}, own bound "
          f"{wh.bound_pp:.2f} pp)")  # fmt: skip
    print(f"  deltas {wh.delta_bytes:,} B in {wh.messages:,} messages = "
          f"{wh.delta_bytes / wh.trace_seconds:.0f} B/s for the pool")  # fmt: skip
    if lv is not None and lv.snapshot_bytes:
        snap = lv.snapshot_bytes / lv.seconds  # both collectors, per second (measured live)
        print(f"  against today's snapshots ({snap:,.0f} B/s for the two collectors, "
              f"measured live): +{100 * wh.delta_bytes / (snap * wh.trace_seconds):.1f}% "
              f"(target <= +{100 * TARGET_TRAFFIC:g}%)")  # fmt: skip
    print(f"  memory: merge {wh.merge_bytes:,} B for {wh.resident_blocks:,} resident blocks = "
          f"{wh.merge_bytes / max(wh.resident_blocks, 1):.2f} B/block; exact seen set "
          f"{wh.seen_bytes:.0f} B per distinct block", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace-seconds", type=float, default=600.0)
    p.add_argument("--speed", type=float, default=10.0)
    p.add_argument("--route", default="random")
    p.add_argument("--capacity", type=int, default=2_000_000, help="tokens per rank")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--salts", type=int, default=20, help="offline draws of the sample (0: none)")
    p.add_argument("--no-live", action="store_true", help="the offline parts only")
    p.add_argument("--no-whole", action="store_true", help="skip the whole-trace traffic pass")
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    header(args)
    lv = None
    if not args.no_live:
        with tempfile.TemporaryDirectory() as d:
            lv = live(args, Path(d))
        report_live(args, lv)
    if args.salts:
        report_offline(args, offline(args))
    if not args.no_whole:
        report_whole(whole(args), lv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
