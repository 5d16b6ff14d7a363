"""Fleet scale: /metrics of one aggregator over NATS, today's renderer beside the cached one.

Run: `python -m benchmarks.scale [--collectors 512] [--ranks 8]` (4,096 streams and a quarter of
that), `--quick` for a smoke run. Synthetic snapshots (no ZMQ) are published once a second per
collector, spread over the second, through a real nats-server to an aggregator subprocess
(Aggregator + create_app, as `kvobserve aggregate` wires them). For each fleet size, each
renderer gets a fresh aggregator and the same steps, in the same run:

- idle: the aggregator's CPU (/proc/<pid>/stat) with no scrape, i.e. snapshot intake;
- cold scrapes, 1.5 s apart (every collector sent a new snapshot since the last one, as for a
  Prometheus scraping every 15 s), plain and gzip: response time (request to last byte) and the
  aggregator's CPU for the scrape (its CPU over the request minus the idle rate);
- back-to-back scrapes, plain and gzip (HA pairs or short intervals: few collectors changed).

"old" is the renderer before the cache (every scrape rendered afresh and, when asked, gzipped
whole; per-stream counters and histograms, 48 series per stream); "new" is the cached renderer
with the default series budget. Cores at a 15 s scrape interval = idle CPU + cold-scrape CPU / 15.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import nats

from benchmarks._common import (
    NatsServer,
    cpu_seconds,
    free_port,
    median,
    percentile,
    stop_process,
    wait_for_port,
)
from kvobserve.analysis.blocks import DEFAULT_LIFETIME_BUCKETS
from kvobserve.transport.subjects import snapshot_subject
from kvobserve.wire.snapshot import (
    CollectorInfo,
    Histogram,
    MediumStats,
    SchedulerStats,
    Snapshot,
    StreamStats,
    WorkerInfo,
    encode_snapshot,
)

CLUSTER = "bench"
DP_SIZE = 16  # a worker spans two collectors (nodes) of 8 ranks each


def synthetic_snapshot(c: int, ranks: int, seq: int, now: float) -> Snapshot:
    """Collector `c`'s snapshot: `ranks` streams of worker c // 2, counters growing with `seq`."""
    worker, node = f"sglang-{c // 2:03d}", c % 2
    first = node * ranks
    bounds = list(DEFAULT_LIFETIME_BUCKETS)
    streams = []
    for r in range(first, first + ranks):
        n = seq * 1000 + r
        counts = [n * (i + 1) // len(bounds) for i in range(len(bounds))]
        streams.append(
            StreamStats(
                worker, r, engine="sglang", endpoint=f"tcp://10.0.{c}.1:{5557 + r}",
                topic="kv-events", up=True, batches_total=n, events={"stored": n, "removed": n // 2},
                media=[MediumStats("GPU", 4096 + r, 65536 + 16 * r, 16 * n, 16 * n - 4096,
                                   Histogram(bounds, counts, n, n * 3.5))],
                replay_requests={"ok": 1}, state_complete=True, last_batch_ts=now - 0.01,
                lag_seconds=0.002,
            )
        )  # fmt: skip
    sched = [
        SchedulerStats(worker, r, "metrics", 3.0, 1.0, 0.4, 0.6, 500_000.0, now)
        for r in range(DP_SIZE)
        if node == 0
    ]
    return Snapshot(
        CollectorInfo(f"node-{c:03d}", node, f"gpu-{c:03d}", now - 3600, CLUSTER, "bench"),
        seq=seq,
        time=now,
        interval_s=1.0,
        workers=[
            WorkerInfo(worker, "sglang", DP_SIZE, list(range(first, first + ranks)), node == 0)
        ],
        streams=streams,
        scheduler=sched,
    )


async def publish_fleet(url: str, collectors: int, ranks: int, stop: asyncio.Event) -> int:
    """Publish every collector's snapshot once a second, spread over the second; bytes sent."""
    nc = await nats.connect(url, name="bench-fleet")
    subjects = [snapshot_subject(CLUSTER, f"node-{c:03d}") for c in range(collectors)]
    sent, seq, start = 0, 0, time.monotonic()
    try:
        while not stop.is_set():
            seq += 1
            for c in range(collectors):
                due = start + (seq - 1) + c / collectors
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                data = encode_snapshot(synthetic_snapshot(c, ranks, seq, time.time()))
                await nc.publish(subjects[c], data)
                sent += len(data)
    finally:
        await nc.drain()
    return sent


def scrape(url: str, packed: bool = False) -> tuple[float, bytes]:
    """(seconds from request to last byte, body as sent) of one GET."""
    headers = {"Accept-Encoding": "gzip"} if packed else {}
    t0 = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as resp:
        body = resp.read()
    return time.perf_counter() - t0, body


async def serve_aggregator(nats_url: str, listen: str, renderer: str) -> None:
    """The aggregator subprocess: NATS in, /metrics out, until SIGTERM."""
    from kvobserve.aggregator import Aggregator
    from kvobserve.analysis.fleet import FleetState
    from kvobserve.export.prometheus import aggregator_metrics
    from kvobserve.export.server import create_app, serve
    from kvobserve.transport.nats import NatsTransport

    transport = NatsTransport(nats_url, CLUSTER, name="bench-aggregator")
    await transport.connect()
    agg = Aggregator(FleetState())
    await agg.start(transport)
    old = renderer == "old"
    app = create_app(
        agg.view,
        extra_metrics=lambda: aggregator_metrics(agg.fleet, agg.decode_errors, transport),
        scrape_cache=not old,
        per_stream_histograms=old,
        per_stream_counters=old,
    )
    http = await serve(app, listen)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await http.close()
    await agg.stop()
    await transport.close()


@dataclass
class Figures:
    """What one renderer measured at one fleet size."""

    streams: int = 0
    idle_cores: float = 0.0
    plain_bytes: int = 0
    gzip_bytes: int = 0
    samples: int = 0
    times: dict[str, list[float]] = field(default_factory=dict)  # cold/warm x plain/gzip
    cpu: list[float] = field(default_factory=list)  # aggregator CPU s per cold scrape

    def p(self, key: str, q: float) -> float:
        """Percentile `q` of the response times `key`, in ms."""
        return 1e3 * (median(self.times[key]) if q == 0.5 else percentile(self.times[key], q))

    @property
    def cpu_per_scrape(self) -> float:
        """Median aggregator CPU seconds of a cold scrape."""
        return median(self.cpu)

    @property
    def cores_at_15s(self) -> float:
        """Intake plus one cold scrape every 15 s."""
        return self.idle_cores + self.cpu_per_scrape / 15.0


async def measure(
    nats_url: str, renderer: str, streams: int, cold: int, warm: int, idle_s: float, workdir: Path
) -> Figures:
    """One aggregator with `renderer`, against the fleet being published."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    with open(workdir / f"aggregate-{renderer}-{streams}.log", "wb") as logf:
        agg = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.scale", "--serve", nats_url,
             "--listen", f"127.0.0.1:{port}", "--renderer", renderer],
            stdout=logf, stderr=subprocess.STDOUT,
        )  # fmt: skip
    f = Figures(streams)
    try:
        wait_for_port(port, 30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # warm-up: every stream seen
            await asyncio.sleep(1.0)
            _, body = await asyncio.to_thread(scrape, url)
            if body.count(b"\nkvobserve_stream_up{") >= streams:
                break
        await asyncio.sleep(1.5)
        c0, t0 = cpu_seconds(agg.pid), time.monotonic()
        await asyncio.sleep(idle_s)
        f.idle_cores = (cpu_seconds(agg.pid) - c0) / (time.monotonic() - t0)
        f.times = {k: [] for k in ("cold", "cold_gz", "warm", "warm_gz")}
        for i in range(2 * cold):
            packed = i % 2 == 1
            await asyncio.sleep(1.5)  # every collector has sent a new snapshot
            c0, t0 = cpu_seconds(agg.pid), time.monotonic()
            took, body = await asyncio.to_thread(scrape, url, packed)
            f.cpu.append(cpu_seconds(agg.pid) - c0 - f.idle_cores * (time.monotonic() - t0))
            f.times["cold_gz" if packed else "cold"].append(took)
            if packed:
                f.gzip_bytes = len(body)
                body = gzip.decompress(body)
            else:
                f.plain_bytes = len(body)
            f.samples = sum(1 for line in body.splitlines() if not line.startswith(b"#"))
        for i in range(2 * warm):
            packed = i % 2 == 1
            took, _ = await asyncio.to_thread(scrape, url, packed)
            f.times["warm_gz" if packed else "warm"].append(took)
    finally:
        stop_process(agg)
    return f


def report(size: str, old: Figures, new: Figures) -> None:
    """The figures of both renderers and their ratios (old / new)."""
    print(f"{size}: {new.streams} streams")
    rows = [
        ("/metrics MB plain", old.plain_bytes / 1e6, new.plain_bytes / 1e6, "{:.2f}"),
        ("/metrics MB gzip", old.gzip_bytes / 1e6, new.gzip_bytes / 1e6, "{:.2f}"),
        ("samples", old.samples, new.samples, "{:,.0f}"),
        ("samples per stream", old.samples / old.streams, new.samples / new.streams, "{:.1f}"),
    ]
    for key, what in (("cold", "cold plain"), ("cold_gz", "cold gzip"),
                      ("warm", "back-to-back plain"), ("warm_gz", "back-to-back gzip")):  # fmt: skip
        for q, qn in ((0.5, "p50"), (0.99, "p99")):
            rows.append((f"{what} {qn} ms", old.p(key, q), new.p(key, q), "{:.0f}"))
    rows += [
        ("CPU s per cold scrape", old.cpu_per_scrape, new.cpu_per_scrape, "{:.3f}"),
        ("idle CPU (intake), cores", old.idle_cores, new.idle_cores, "{:.3f}"),
        ("cores at a 15 s scrape interval", old.cores_at_15s, new.cores_at_15s, "{:.3f}"),
    ]
    print(f"  {'':34s} {'old':>10s} {'new':>10s} {'old/new':>8s}")
    for name, a, b, fmt in rows:
        ratio = f"{a / b:.1f}x" if b else "-"
        print(f"  {name:34s} {fmt.format(a):>10s} {fmt.format(b):>10s} {ratio:>8s}")


async def run(
    collectors: int, ranks: int, cold: int, warm: int, idle_s: float, workdir: Path
) -> dict[int, tuple[Figures, Figures]]:
    """Both renderers at a quarter of the fleet and at the full fleet, one nats-server."""
    out: dict[int, tuple[Figures, Figures]] = {}
    with NatsServer(workdir / "nats.log") as srv:
        for n in sorted({max(2, collectors // 4), collectors}):
            stop = asyncio.Event()
            pub = asyncio.create_task(publish_fleet(srv.url, n, ranks, stop))
            try:
                figs = [
                    await measure(srv.url, r, n * ranks, cold, warm, idle_s, workdir)
                    for r in ("old", "new")
                ]
            finally:
                stop.set()
                await pub
            out[n * ranks] = (figs[0], figs[1])
            report(f"{n} collectors x {ranks} ranks", *figs)
    return out


def main(argv: list[str] | None = None) -> int:
    """Measure and print; returns 0."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__)
    p.add_argument("--collectors", type=int, default=512)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--cold", type=int, default=8, help="cold scrapes per encoding")
    p.add_argument("--warm", type=int, default=20, help="back-to-back scrapes per encoding")
    p.add_argument("--idle", type=float, default=10.0, help="seconds of intake-only CPU")
    p.add_argument("--quick", action="store_true", help="a smoke run: 8 collectors, 2 scrapes")
    p.add_argument("--serve", metavar="NATS_URL", help=argparse.SUPPRESS)
    p.add_argument("--listen", help=argparse.SUPPRESS)
    p.add_argument("--renderer", choices=("old", "new"), default="new", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        asyncio.run(serve_aggregator(args.serve, args.listen, args.renderer))
        return 0
    if args.quick:
        args.collectors, args.cold, args.warm, args.idle = 8, 2, 2, 1.0
    print(f"python -m benchmarks.scale --collectors {args.collectors} --ranks {args.ranks} "
          f"--cold {args.cold} --warm {args.warm} --idle {args.idle:g}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvobserve-scale-") as tmp:
        asyncio.run(run(args.collectors, args.ranks, args.cold, args.warm, args.idle, Path(tmp)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
