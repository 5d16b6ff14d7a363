"""Where the misses come from, across collectors: the sampled split's error and cost, in one run.

Run: `python -m benchmarks.misses [--trace-seconds 600] [--speed 10] [--route random]
[--salts 20]`. The targets (docs/cache-analytics.md, "Where the misses come from"): each share
within 2 percentage points once a pool has seen 10,000 stores; NATS traffic at most +10 % over
today's snapshots; at most +10 bytes per resident block.

Live: the trace fixture (its first `--trace-seconds` at `--speed`) is replayed by
`kvobserve simulate` on 4 ranks over two loopback nodes (127.0.0.1: ranks 0-1, 127.0.0.2: ranks
2-3); two `kvobserve collect` processes, one per node, publish today's snapshots to a real
nats-server. This process subscribes to the 4 ranks, feeds each node's ranks to that node's
`MissSampler`, publishes each sampler's delta every second on NATS from a connection of its own,
and merges the deltas in a `SampledSplit`. Traffic is what nats-server counted into each
connection (`/connz` `in_bytes`) over the replay; error is each share of the merged estimate
against the simulator's truth at the end; memory is the merge's sets per block resident in the
pool. For reference, an exact `PoolMisses` over all 4 ranks in this process (what one collector
would compute, in arrival order) against the truth.

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
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import zmq

from benchmarks._common import (
    HOSTS,
    ROOT,
    NatsServer,
    node_collector_toml,
    sim_endpoints,
    spawn_kvobserve,
    stop_process,
)
from kvobserve.analysis.blocks import BlockIndex
from kvobserve.analysis.miss_sample import KIND_NAMES, MissSampler, SampledSplit
from kvobserve.analysis.misses import MissCounts, PoolMisses
from kvobserve.simulate.replay import replay_offline
from kvobserve.simulate.trace import read_trace
from kvobserve.wire.kv_events import KvBatch, decode_message, decode_payload
from kvobserve.wire.misses import decode_delta, encode_delta

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


# --- live: the simulator, two collectors, NATS -------------------------------------------------


def connz(nats_server: NatsServer) -> dict[str, int]:
    """Connection name -> bytes nats-server received from it."""
    url = f"http://127.0.0.1:{nats_server.monitor_port}/connz"
    with urllib.request.urlopen(url, timeout=5) as resp:
        doc = json.load(resp)
    return {c.get("name", str(c["cid"])): int(c["in_bytes"]) for c in doc.get("connections", [])}


@dataclass
class Live:
    """What the live run measured."""

    seconds: float = 0.0
    delta_bytes: int = 0  # into NATS from the deltas' connection
    snapshot_bytes: int = 0  # into NATS from the two collectors, over the same time
    estimate: dict[str, float] = field(default_factory=dict)
    sampled: int = 0
    bound: float = 0.0
    level: int = 0
    truth: dict[str, float] = field(default_factory=dict)
    exact_in_arrival_order: dict[str, float] = field(default_factory=dict)
    stores: int = 0
    merge_bytes: int = 0
    resident_blocks: int = 0
    late_ops: int = 0


async def _consume(
    args: argparse.Namespace, kv: dict[int, str], nats_server: NatsServer, truth_path: Path
) -> Live:
    nc = await nats.connect(nats_server.url, name=ME)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    samplers = [MissSampler(CLUSTER, True) for _ in range(2)]
    merged = SampledSplit()
    indexes = {r: BlockIndex() for r in kv}
    pool = PoolMisses()
    for r, ix in indexes.items():
        pool.attach(r, ix)
    poller = zmq.Poller()
    subs: dict[Any, int] = {}
    for r, url in kv.items():
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(url)
        subs[sub] = r
        poller.register(sub, zmq.POLLIN)
    out = Live()
    try:
        before = connz(nats_server)
        t0 = last_batch = time.monotonic()
        next_ship = t0 + 1.0

        async def ship(until: float) -> None:
            for k, s in enumerate(samplers):
                data = encode_delta(s.delta(until))
                await nc.publish(f"kvobserve.v1.{CLUSTER}.misses.node-{k}", data)
                merged.add(f"node-{k}", decode_delta(data))
            merged.advance()
            # the pool's level back to the collectors: counted as traffic too
            await nc.publish(f"kvobserve.v1.{CLUSTER}.misses_level", str(merged.level).encode())
            for s in samplers:
                s.follow(merged.level)

        while True:
            await asyncio.sleep(0)  # the NATS client's flusher runs
            for sock, _ in poller.poll(50):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    b: KvBatch = decode_message(frames)
                    r = subs[sock]
                    indexes[r].apply_batch(b)
                    samplers[r // 2].observe(r, b)
                    last_batch = time.monotonic()
            now = time.monotonic()
            if now >= next_ship:
                await ship(time.time() - 0.5)
                next_ship += 1.0
            doc = _truth(truth_path)
            if doc and doc["done"] and doc["pending_events"] == 0 and now - last_batch > 2.0:
                break
            if now - t0 > args.timeout:
                raise TimeoutError(f"the replay did not finish in {args.timeout} s")
        await ship(math.inf)
        await nc.flush()
        after = connz(nats_server)
        out.seconds = time.monotonic() - t0
        out.delta_bytes = after.get(ME, 0)
        out.snapshot_bytes = sum(
            v - before.get(name, 0) for name, v in after.items() if name.startswith("kvobserve-")
        )
        est = merged.estimate()
        out.estimate, out.sampled, out.bound, out.level = (
            est.shares,
            est.sampled,
            est.bound,
            est.level,
        )
        out.exact_in_arrival_order = shares(pool.totals())
        out.merge_bytes = split_bytes(merged)
        out.late_ops = merged.late_ops
        return out
    finally:
        await nc.close()
        ctx.destroy(linger=0)


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
                procs.append(
                    spawn_kvobserve(["collect", "-c", str(cfg)], workdir / f"node-{node}.log")
                )
            out = asyncio.run(_consume(args, kv, nats_server, truth_path))
        finally:
            for p in reversed(procs):
                stop_process(p)
        doc = json.loads(truth_path.read_text())
    replay = doc["replays"][0]
    c = truth_counts(replay["pool"]["pages"])
    out.truth, out.stores = shares(c), c.total
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
    ratio = lv.delta_bytes / lv.snapshot_bytes if lv.snapshot_bytes else math.inf
    per_block = lv.merge_bytes / max(lv.resident_blocks, 1)
    print(f"\nlive at {args.speed:g}x: {lv.seconds:.0f} s, {lv.stores:,} stores (pages)")
    print(f"  truth                      {_pct(lv.truth)}")
    print(f"  sampled estimate           {_pct(lv.estimate)}   n={lv.sampled:,} "
          f"level={lv.level} own bound={100 * lv.bound:.2f} pp")  # fmt: skip
    print(f"  exact, one process         {_pct(lv.exact_in_arrival_order)}   (arrival order)")
    print(f"  error: {err:.2f} pp (target <= {TARGET_PP:g})  late ops {lv.late_ops}")
    print(f"  NATS: deltas {lv.delta_bytes:,} B / snapshots {lv.snapshot_bytes:,} B = "
          f"+{100 * ratio:.1f}% (target <= +{100 * TARGET_TRAFFIC:g}%); at 1x the same deltas "
          f"over {args.speed:g}x the snapshots: +{100 * ratio / args.speed:.1f}%")  # fmt: skip
    print(f"  memory: merge {lv.merge_bytes:,} B for {lv.resident_blocks:,} resident blocks = "
          f"{per_block:.2f} B/block (target <= {TARGET_BYTES:g})", flush=True)  # fmt: skip


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
