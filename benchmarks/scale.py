"""Fleet scale: 1,024 streams (128 collectors x 8 ranks) into one `kvobserve aggregate` over NATS.

Run: `python -m benchmarks.scale [--seconds 30]`. Synthetic snapshots (no ZMQ) are published
once a second per collector, spread evenly over the second, through a real nats-server to an
aggregator subprocess. Phase 1 measures the aggregator's CPU share (/proc/<pid>/stat) and RSS
with a Prometheus-like scrape every 15 s; phase 2 scrapes /metrics back to back and reports the
response time p50/p99 (request to last byte). NATS bytes/s come from the server's /varz.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import nats

from benchmarks._common import (
    NatsServer,
    cpu_seconds,
    free_port,
    median,
    percentile,
    rss_bytes,
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


def scrape(url: str) -> tuple[float, bytes]:
    """(seconds from request to last byte, body) of one GET."""
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as resp:
        body = resp.read()
    return time.perf_counter() - t0, body


async def run(
    seconds: float,
    collectors: int,
    ranks: int,
    scrapes: int,
    workdir: Path,
    profile: Path | None = None,
) -> None:
    """Both phases against one nats-server and one aggregator subprocess."""
    with NatsServer(workdir / "nats.log") as srv:
        port = free_port()
        with open(workdir / "aggregate.log", "wb") as logf:
            agg = subprocess.Popen(
                [sys.executable, "-m", "kvobserve", "aggregate", "--nats", srv.url,
                 "--cluster", CLUSTER, "--listen", f"127.0.0.1:{port}"],
                stdout=logf, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            wait_for_port(port, 20)
            stop = asyncio.Event()
            pub = asyncio.create_task(publish_fleet(srv.url, collectors, ranks, stop))
            url = f"http://127.0.0.1:{port}/metrics"
            # warm-up: every collector seen once
            deadline = time.monotonic() + 30
            streams = 0
            while time.monotonic() < deadline:
                await asyncio.sleep(1.0)
                _, body = await asyncio.to_thread(scrape, url)
                streams = body.count(b"\nkvobserve_stream_up{")
                if streams >= collectors * ranks:
                    break
            v0, cpu0, t0 = srv.varz(), cpu_seconds(agg.pid), time.monotonic()
            next_scrape = t0
            while (now := time.monotonic()) < t0 + seconds:
                if now >= next_scrape:  # a Prometheus at a 15 s scrape interval
                    await asyncio.to_thread(scrape, url)
                    next_scrape += 15.0
                await asyncio.sleep(0.25)
            cpu = (cpu_seconds(agg.pid) - cpu0) / (time.monotonic() - t0)
            v1 = srv.varz()
            rss = rss_bytes(agg.pid)
            spy = None
            if profile is not None:  # py-spy samples the aggregator through the scrape phase
                spy = subprocess.Popen(
                    [str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(agg.pid),
                     "-o", str(profile), "--format", "raw", "-r", "200", "--threads"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                await asyncio.sleep(1.0)
            times, size, samples = [], 0, 0
            for _ in range(scrapes):
                took, body = await asyncio.to_thread(scrape, url)
                times.append(took)
                size = len(body)
                samples = sum(1 for line in body.splitlines() if not line.startswith(b"#"))
            rss_after = rss_bytes(agg.pid)
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                spy.wait(timeout=30)
            stop.set()
            await pub
        finally:
            stop_process(agg)
    span = seconds
    in_bps = (v1["in_bytes"] - v0["in_bytes"]) / span
    out_bps = (v1["out_bytes"] - v0["out_bytes"]) / span
    print(f"{collectors} collectors x {ranks} ranks = {collectors * ranks} streams "
          f"({streams} served); {seconds:.0f} s window")  # fmt: skip
    print(f"aggregator CPU {cpu:.3f} core (1 snapshot/s per collector, a scrape every 15 s)")
    print(f"aggregator RSS {rss / 2**20:.1f} MiB (after the scrape phase {rss_after / 2**20:.1f})")
    print(f"NATS in {in_bps / 1e3:.1f} kB/s, out {out_bps / 1e3:.1f} kB/s")
    print(
        f"/metrics: {size / 1e6:.2f} MB, {samples:,} samples; response time over {scrapes} "
        f"scrapes p50 {1e3 * median(times):.0f} ms, p99 {1e3 * percentile(times, 0.99):.0f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    """Run both phases and print the figures; returns 0."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__)
    p.add_argument("--seconds", type=float, default=30.0, help="CPU measurement window")
    p.add_argument("--collectors", type=int, default=128)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--scrapes", type=int, default=50)
    p.add_argument("--py-spy", type=Path, default=None, help="py-spy raw profile of the scrapes")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvobserve-scale-") as tmp:
        asyncio.run(
            run(args.seconds, args.collectors, args.ranks, args.scrapes, Path(tmp), args.py_spy)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
