"""Soak: a collector under 20k batches/s with faults for 10 minutes; RSS growth and exact counts.

Run: `python -m benchmarks.soak [--minutes 10] [--rate 20000] [--ranks 4]` (`make soak`).

A publisher process plays a vLLM engine with `--ranks` DP ranks (PUB on base + r, replay ROUTER
with a ring). Each batch stores one block and, once `WINDOW` blocks are resident, removes the
oldest, so the engine's cache is always known. Faults at fixed seqs of every publisher instance:
live drops kept in the ring (the collector must replay them), malformed payloads (lost for good,
counted as `msgpack`), and a restart every `--restart-every` batches (new sockets on the same
ports, seq from 0, empty cache and ring). The collector (with an aggregator on the in-process bus
and a /metrics render every second) runs in this process. At the end the collector's counters
and resident block sets must equal the publisher's truth exactly, and RSS must have grown less
than 10% between the end of the warm-up (10% of the run, at least 10 s) and the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from kvobserve.aggregator import Aggregator
from kvobserve.analysis.fleet import FleetState
from kvobserve.collector import Collector
from kvobserve.config import load_config
from kvobserve.export.prometheus import FleetCollector
from kvobserve.transport.local import LocalBus
from kvobserve.wire.snapshot import Snapshot

WORKER = "soak"
WINDOW = 256  # blocks resident per publisher instance at steady state
RING = 20_000  # replay ring per rank (batches)
MALFORMED = b"\xc1"  # the one byte msgpack never uses
END = [b"", b"\xff" * 8, b""]  # replay end marker, 3-frame layout (vLLM <= 0.25)


# --- the publisher process ------------------------------------------------------------------------


def fault(seq: int, restart_every: int) -> str:
    """The fault planned for `seq` of every instance: isolated, never in an instance's last 100."""
    if seq >= restart_every - 100:
        return ""
    if seq % 1009 == 503:
        return "drop"
    if seq % 1511 == 701 and (seq - 1) % 1009 != 503 and (seq + 1) % 1009 != 503:
        return "malformed"
    return ""


class _Rank:
    """One DP rank of the simulated engine: XPUB (to see subscriptions), ROUTER, ring, truth."""

    def __init__(self, ctx: zmq.Context[Any], rank: int, kv_port: int, replay_port: int) -> None:
        self.ctx, self.rank, self.kv_port = ctx, rank, kv_port
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.SNDHWM, 0)  # a replay reply is never cut short
        self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        self.pub = self._bind_pub()
        self.subscribed = False
        self.ring: deque[tuple[int, bytes, bytes]] = deque(maxlen=RING)
        self.window: deque[int] = deque()
        self.seq = 0
        self.next_hash = (rank + 1) << 40
        self.truth = {"assigned": 0, "drops": 0, "malformed": 0, "restarts": 0}

    def _bind_pub(self) -> zmq.Socket[Any]:
        sock = self.ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        for _ in range(500):  # the old socket releases the port asynchronously
            try:
                sock.bind(f"tcp://127.0.0.1:{self.kv_port}")
                return sock
            except zmq.ZMQError:
                time.sleep(0.01)
        raise OSError(f"port {self.kv_port} did not become free")

    def ready(self) -> bool:
        """True once the collector's SUB subscribed to this (instance's) socket."""
        while not self.subscribed and self.pub.poll(0):
            self.subscribed = self.pub.recv()[:1] == b"\x01"
        return self.subscribed

    def publish(self, restart_every: int, stopping: bool) -> None:
        """One batch: store a block, evict the oldest past WINDOW; faults as planned."""
        seq, what = self.seq, "" if stopping else fault(self.seq, restart_every)
        self.seq += 1
        self.truth["assigned"] += 1
        seq_b = seq.to_bytes(8, "big")
        if what == "malformed":
            self.truth["malformed"] += 1
            payload = MALFORMED  # no cache change, as an engine's garbled message would carry
        else:
            h = self.next_hash
            self.next_hash += 1
            events: list[Any] = [["BlockStored", [h], self.window[-1] if self.window else None,
                                  [1, 2, 3, 4], 16, None, "GPU"]]  # fmt: skip
            self.window.append(h)
            if len(self.window) > WINDOW:
                events.append(["BlockRemoved", [self.window.popleft()], "GPU"])
            payload = msgspec.msgpack.encode([time.time(), events, self.rank])
        self.ring.append((seq, seq_b, payload))
        if what == "drop":
            self.truth["drops"] += 1  # lost on the wire, kept in the ring
        else:
            self.pub.send_multipart([b"", seq_b, payload], copy=False)
        if not stopping and self.seq >= restart_every:
            self.restart()

    def restart(self) -> None:
        """A new engine process: new PUB on the same port, seq from 0, empty cache and ring."""
        self.pub.close(0)
        self.pub = self._bind_pub()
        self.subscribed = False
        self.seq = 0
        self.ring.clear()
        self.window.clear()
        self.truth["restarts"] += 1

    def serve_replay(self) -> None:
        """Answer `[id, "", start]` with every ring batch >= start, then the end marker."""
        while self.router.poll(0):
            ident, *req = self.router.recv_multipart()
            if len(req) != 2 or len(req[1]) != 8:
                continue
            start = int.from_bytes(req[1], "big")
            for seq, seq_b, payload in self.ring:
                if seq >= start:
                    self.router.send_multipart([ident, b"", seq_b, payload], copy=False)
            self.router.send_multipart([ident, *END])


def publish(ctl: Connection, ranks: int, rate: float, restart_every: int, total: Any) -> None:
    """The publisher process: ports to `ctl`, wait for "go", publish until "stop", send truth."""
    from kvobserve.simulate.ports import free_port_range

    ctx: zmq.Context[Any] = zmq.Context()
    kv, rp = free_port_range("127.0.0.1", ranks + 1), free_port_range("127.0.0.1", ranks)
    rs = [_Rank(ctx, r, kv + r, rp + r) for r in range(ranks)]
    ctl.send((kv, rp))
    while not ctl.poll(0.01):
        for r in rs:
            r.ready()
    ctl.recv()
    t0, sent, stopping = time.monotonic(), 0, False
    tail = dict.fromkeys(range(ranks), 0)  # clean batches per rank after "stop"
    while min(tail.values()) < 20:
        due = int((time.monotonic() - t0) * rate)
        burst = 0
        while sent < due and burst < 2000:
            for r in rs:  # round robin over the ranks that have a subscriber
                if r.ready():
                    r.publish(restart_every, stopping)
                    burst += 1
                    tail[r.rank] += stopping
            sent += len(rs)
        total.value = sum(r.truth["assigned"] for r in rs)  # for the collector side's lag
        for r in rs:
            r.serve_replay()
        if not stopping and ctl.poll(0):
            ctl.recv()
            stopping = True  # from now on a clean tail: every fault is followed by a batch
        if sent >= due:
            time.sleep(0.0005)
    truth = {str(r.rank): {**r.truth, "resident": list(r.window)} for r in rs}
    ctl.send(json.dumps({"ranks": truth}))
    while not ctl.poll(0.001):  # answer replays until the collector has caught up
        for r in rs:
            r.serve_replay()
    ctx.destroy(linger=0)


# --- the collector side ---------------------------------------------------------------------------


def rss_bytes() -> int:
    """This process's resident set size."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def expected(truth: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Per rank, the counters the collector must report (cumulative over publisher instances)."""
    out: dict[int, dict[str, Any]] = {}
    for rank, t in truth["ranks"].items():
        drops, bad = t["drops"], t["malformed"]
        out[int(rank)] = {
            "batches_total": t["assigned"] - bad,
            "gaps": drops + bad,  # faults are isolated: one hole each
            "missed": drops + bad,
            "recovered": drops,
            "lost": bad,
            "restarts": t["restarts"],
            "decode_errors": {"msgpack": bad} if bad else {},
        }
    return out


def actual(snap: Snapshot) -> dict[int, dict[str, Any]]:
    """The same fields from a collector snapshot."""
    return {
        s.dp_rank: {
            "batches_total": s.batches_total,
            "gaps": s.gaps,
            "missed": s.missed,
            "recovered": s.recovered,
            "lost": s.lost,
            "restarts": s.restarts,
            "decode_errors": dict(s.decode_errors),
        }
        for s in snap.streams
        if s.worker_id == WORKER
    }


async def _wait(col: Collector, pred: Any, timeout_s: float) -> Snapshot:
    end = time.monotonic() + timeout_s
    while True:
        snap = await col.snapshot()
        if pred(snap) or time.monotonic() > end:
            return snap
        await asyncio.sleep(0.1)  # polling interval


async def soak(args: argparse.Namespace) -> int:
    """Run the soak; 0 when counts are exact and RSS growth is under the bound."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    total = ctx.Value("q", 0, lock=False)  # batches published so far
    pub = ctx.Process(
        target=publish,
        args=(theirs, args.ranks, args.rate, args.restart_every, total),
        daemon=True,
    )
    pub.start()
    kv_base, replay_base = ours.recv()
    cfg = load_config(
        None,
        {
            "collector.id": "soak-node",
            "collector.interval_s": 1.0,
            "worker.id": WORKER,
            "worker.engine": "vllm",
            "worker.dp_size": args.ranks,
            "worker.kv_endpoint": f"tcp://127.0.0.1:{kv_base}",
            "worker.replay_endpoint": f"tcp://127.0.0.1:{replay_base}",
        },
        {},
    )
    bus = LocalBus()
    agg = Aggregator(FleetState())
    await agg.start(bus)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(agg.view))
    col = Collector(cfg, bus)
    await col.start()
    ok = False
    try:
        await _wait(col, lambda s: all(x.up for x in s.streams), 20)
        ours.send("go")  # the publisher waits for our subscriptions before its first batch
        ok = await _run(args, col, registry, ours, total)
    finally:
        await col.close()
        await agg.stop()
        await bus.close()
        pub.join(10)
        if pub.is_alive():
            pub.kill()
    return 0 if ok else 1


async def _run(
    args: argparse.Namespace,
    col: Collector,
    registry: CollectorRegistry,
    ctl: Connection,
    total: Any,
) -> bool:
    duration = args.minutes * 60.0
    warmup = max(10.0, duration / 10)
    t0 = time.monotonic()
    rss_warm = 0
    peak = max_lag = 0
    last_batches, last_t = 0, t0
    next_report = t0 + 10
    scrape_bytes = 0
    while (now := time.monotonic()) - t0 < duration:
        scrape_bytes = len(generate_latest(registry))  # what Prometheus would do every second
        rss = rss_bytes()
        peak = max(peak, rss)
        if not rss_warm and now - t0 >= warmup:
            rss_warm = rss
        if now >= next_report:
            snap = await col.snapshot()
            batches = sum(s.batches_total for s in snap.streams)
            lag = max(0, total.value - batches)  # published, not yet applied (a backlog)
            max_lag = max(max_lag, lag)
            rate = (batches - last_batches) / (now - last_t)
            print(f"t={now - t0:6.0f}s batches={batches:>10,} rate={rate:>8,.0f}/s lag={lag:>8,} "
                  f"rss={rss / 2**20:6.1f} MiB scrape={scrape_bytes:,} B", flush=True)  # fmt: skip
            last_batches, last_t, next_report = batches, now, now + 10
        await asyncio.sleep(1.0)
    rss_end = rss_bytes()
    ctl.send("stop")
    truth: dict[str, Any] = json.loads(ctl.recv())
    want = expected(truth)
    snap = await _wait(col, lambda s: actual(s) == want, 60)
    ctl.send("done")
    got = actual(snap)
    seqs = {r: col.ingest.sequencer(WORKER, r) for r in want} if col.ingest else {}
    resident = await asyncio.wrap_future(
        col.ingest.call(lambda: {r: s.index.resident_hashes() for r, s in seqs.items() if s})
    ) if col.ingest else {}  # fmt: skip
    resident_ok = all(
        {h for hs in resident.get(r, {}).values() for h in hs} == set(t["resident"])
        for r, t in ((int(k), v) for k, v in truth["ranks"].items())
    )
    growth = (rss_end - rss_warm) / rss_warm if rss_warm else float("inf")
    sent = sum(t["assigned"] for t in truth["ranks"].values())
    result = {
        "minutes": args.minutes,
        "target_rate": args.rate,
        "batches_published": sent,
        "achieved_rate": round(sent / duration),
        "restarts": sum(t["restarts"] for t in truth["ranks"].values()),
        "drops_replayed": sum(t["drops"] for t in truth["ranks"].values()),
        "malformed": sum(t["malformed"] for t in truth["ranks"].values()),
        "rss_after_warmup_mib": round(rss_warm / 2**20, 1),
        "rss_end_mib": round(rss_end / 2**20, 1),
        "rss_peak_mib": round(peak / 2**20, 1),
        "max_lag_batches": max_lag,
        "rss_growth_pct": round(100 * growth, 2),
        "counts_exact": got == want,
        "resident_exact": resident_ok,
        "scrape_bytes": scrape_bytes,
    }
    print(json.dumps(result), flush=True)
    for r in sorted(want):
        if got.get(r) != want[r]:
            print(f"rank {r}: got {got.get(r)}\n        want {want[r]}", file=sys.stderr)
    return bool(got == want and resident_ok and growth < 0.10)


def main(argv: list[str] | None = None) -> int:
    """Parse flags and run."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__)
    p.add_argument("--minutes", type=float, default=10.0, help="run time (default 10)")
    p.add_argument("--rate", type=float, default=20_000.0, help="batches/s, all ranks together")
    p.add_argument("--ranks", type=int, default=4, help="DP ranks of the simulated engine")
    p.add_argument(
        "--restart-every", type=int, default=150_000, help="batches per publisher instance"
    )
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.rate <= 0 or args.ranks < 1 or args.restart_every < 1000:
        p.error("--minutes and --rate must be > 0, --ranks >= 1, --restart-every >= 1000")
    return asyncio.run(soak(args))


if __name__ == "__main__":
    raise SystemExit(main())
