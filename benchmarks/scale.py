"""Fleet scale: /metrics of aggregators over NATS; today's renderer beside this one, or shards.

Run: `python -m benchmarks.scale [--collectors 512] [--ranks 8]` (4,096 streams and a quarter of
that), `--shards 4 --collectors 2048` for 16,384 streams over 4 sharded aggregators, `--quick`
for a smoke run. Synthetic snapshots (no ZMQ) are published once a second per collector, spread
over the second, through a real nats-server to aggregator subprocesses (Aggregator + create_app,
as `kvobserve aggregate` wires them). Scrapes come from client processes of their own (as
Prometheus is one), which time them. The aggregators of one measurement run side by side, so
machine load hits them alike:

- idle: each aggregator's CPU (/proc/<pid>/stat) with no scrape, i.e. snapshot intake;
- steady: as Prometheus scrapes, every `--interval` s (every collector has sent new snapshots
  in between) by one scraper per aggregator, plain and then gzip (one Prometheus asks for one
  format), the aggregators' phases spread over the interval: response time (request to last
  byte) of the scrapes from the fourth on (render-ahead needs two agreeing intervals first), and
  the aggregator's CPU per scrape (its CPU over both phases minus the idle rate, over the
  scrapes: renders ahead included);
- one-off cold scrapes, 1.5 s apart, each from a new loopback address (curl, a first scrape):
  rendered on request, plain and gzip, response time and CPU;
- back-to-back scrapes, plain and gzip (fast pollers: rendered on request).

"main" is the aggregator before render-ahead (`render_ahead_s = 0`: every body rendered on
request); "new" is this one. Cores at a 15 s scrape interval = idle CPU + steady CPU / 15.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import http.client
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
from kvobserve.export.ahead import SERVED
from kvobserve.transport.subjects import snapshot_subject
from kvobserve.wire.parts import worker_bucket
from kvobserve.wire.snapshot import (
    BUCKETS,
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
    stats = (3.0, 1.0, 0.4, 0.6, 500_000.0, now)
    sched = [SchedulerStats(worker, r, "metrics", *stats) for r in range(DP_SIZE) if node == 0]
    bucket = worker_bucket(worker)  # one worker: one part (wire/snapshot.py split_parts)
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
        bucket=bucket,
        buckets=[bucket],
    )


async def publish_fleet(url: str, collectors: int, ranks: int, stop: asyncio.Event) -> int:
    """Publish every collector's snapshot once a second, spread over the second; bytes sent."""
    nc = await nats.connect(url, name="bench-fleet")
    subjects = [
        snapshot_subject(CLUSTER, f"node-{c:03d}", worker_bucket(f"sglang-{c // 2:03d}"))
        for c in range(collectors)
    ]
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


def scrape(url: str, packed: bool = False, source: str = "") -> tuple[float, bytes]:
    """(seconds from request to last byte, body as sent) of one GET, from `source` if given."""
    host, _, rest = url.removeprefix("http://").partition("/")
    name, _, port = host.rpartition(":")
    headers = {"Accept-Encoding": "gzip"} if packed else {}
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(
        name, int(port), timeout=60, source_address=(source, 0) if source else None
    )
    try:
        conn.request("GET", "/" + rest, headers=headers)
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise RuntimeError(f"GET {url}: HTTP {resp.status}")
    return time.perf_counter() - t0, body


async def serve_aggregator(
    nats_url: str, listen: str, renderer: str, shard: int = 0, shards: int = 1
) -> None:
    """The aggregator subprocess: NATS in, /metrics out, until SIGTERM."""
    from kvobserve.aggregator import Aggregator, tune_runtime
    from kvobserve.analysis.fleet import FleetState
    from kvobserve.export.prometheus import aggregator_metrics
    from kvobserve.export.server import create_app, serve
    from kvobserve.transport.nats import NatsTransport

    transport = NatsTransport(
        nats_url, CLUSTER, name="bench-aggregator", shard=shard, shards=shards
    )
    await transport.connect()
    agg = Aggregator(FleetState())
    label = str(shard) if shards > 1 else ""
    app = create_app(
        agg.view,
        extra_metrics=lambda: aggregator_metrics(agg.fleet, agg.decode_errors, transport, label),
        shard=label,
        render_ahead_s=0.0 if renderer == "main" else 2.0,  # main: before render-ahead
    )
    _count_cpu(app)
    app.router.add_get("/bench/served", lambda _: _served(app))  # the steady phase's counts
    await agg.start(transport)
    tune_runtime()  # as `kvobserve aggregate` does once started
    http = await serve(app, listen)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await http.close()
    await agg.stop()
    await transport.close()


_CPU = {"renders": 0, "render_cpu_s": 0.0, "views": 0, "view_cpu_s": 0.0}


def _count_cpu(app: Any) -> None:
    """Count the CPU time (time.thread_time) of each /metrics body rendered from the scrape
    cache and of each view taken for one: what machine load does not distort."""
    from kvobserve.export.server import CACHE, FLEET

    cache, fleet = app[CACHE], app[FLEET]
    render, take = cache.render, fleet.take

    def timed_render(*args: Any, **kwargs: Any) -> bytes:
        t0 = time.thread_time()
        try:
            return render(*args, **kwargs)
        finally:
            _CPU["renders"] += 1
            _CPU["render_cpu_s"] += time.thread_time() - t0

    def timed_take() -> Any:
        t0 = time.thread_time()
        try:
            return take()
        finally:
            _CPU["views"] += 1
            _CPU["view_cpu_s"] += time.thread_time() - t0

    cache.render, fleet.take = timed_render, timed_take


async def _served(app: Any) -> Any:
    """How the aggregator answered /metrics so far (export/ahead.py), and its render CPU."""
    from aiohttp import web

    from kvobserve.export.server import AHEAD

    return web.json_response({**app[AHEAD].served, **_CPU})


def served(url: str) -> dict[str, float]:
    """The aggregator's answers so far (ahead, in_flight, on_request) and its render CPU."""
    _, body = scrape(url.replace("/metrics", "/bench/served"))
    got: dict[str, float] = json.loads(body)
    return got


@dataclass
class Figures:
    """What one renderer measured at one fleet size."""

    streams: int = 0
    idle_cores: float = 0.0
    plain_bytes: int = 0
    gzip_bytes: int = 0
    samples: int = 0
    times: dict[str, list[float]] = field(default_factory=dict)  # (steady|cold|warm)[_gz]
    steady_cpu: float = 0.0  # aggregator CPU s per steady scrape (renders ahead included)
    served: dict[str, int] = field(default_factory=dict)  # steady requests by how answered
    cold_cpu: list[float] = field(default_factory=list)  # aggregator CPU s per one-off scrape
    # CPU s of one-off scrapes' renders (render thread) and views (loop), by thread_time
    cold_render_cpu: list[float] = field(default_factory=list)
    fixed: dict[tuple[str, float], float] = field(default_factory=dict)  # ms, over rounds

    def p(self, key: str, q: float) -> float:
        """Percentile `q` of the response times `key`, in ms."""
        if (key, q) in self.fixed:
            return self.fixed[(key, q)]
        return 1e3 * (median(self.times[key]) if q == 0.5 else percentile(self.times[key], q))

    @property
    def cores_at_15s(self) -> float:
        """Intake plus one steady scrape every 15 s."""
        return self.idle_cores + self.steady_cpu / 15.0

    def keep(self, body: bytes, packed: bool) -> None:
        """Note a body's size and samples."""
        if packed:
            self.gzip_bytes = len(body)
            body = gzip.decompress(body)
        else:
            self.plain_bytes = len(body)
        self.samples = sum(1 for line in body.splitlines() if not line.startswith(b"#"))


@dataclass
class Agg:
    """One aggregator subprocess being measured."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str
    fig: Figures


def start_aggregator(
    nats_url: str,
    renderer: str,
    streams: int,
    workdir: Path,
    shard: int = 0,
    shards: int = 1,
    tree: Path | None = None,
) -> Agg:
    """An aggregator subprocess serving `streams` streams (its shard's); with `tree`, the
    kvobserve package of that checkout (this benchmark's harness around it)."""
    port = free_port()
    name = f"{renderer}-{shard}of{shards}-{streams}"
    cwd = None
    if tree is not None:  # `python -m` puts the working directory first on the path
        name = f"{tree.name}-{name}"
        cwd = workdir / f"tree-{tree.name}"
        cwd.mkdir(exist_ok=True)
        for pkg, where in (("kvobserve", tree), ("benchmarks", Path(__file__).parents[1])):
            if not (cwd / pkg).exists():
                (cwd / pkg).symlink_to(where.resolve() / pkg)
    with open(workdir / f"aggregate-{name}.log", "wb") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.scale", "--serve", nats_url,
             "--listen", f"127.0.0.1:{port}", "--renderer", renderer,
             "--shard", str(shard), "--shards", str(shards)],
            stdout=logf, stderr=subprocess.STDOUT, cwd=cwd,
        )  # fmt: skip
    return Agg(name, proc, f"http://127.0.0.1:{port}/metrics", Figures(streams))


@dataclass
class Plan:
    """How many scrapes of each kind, and the steady interval."""

    steady: int = 10  # per steady scraper; the first LEARN are rendered on request
    interval_s: float = 3.0
    cold: int = 8  # one-off scrapes per encoding
    warm: int = 20  # back-to-back scrapes per encoding
    idle_s: float = 10.0


LEARN = 3  # render-ahead needs two agreeing intervals: the fourth request is the first ahead


class Clients:
    """scrape() in client processes of their own, as Prometheus is one: in this process the
    publisher would hold the GIL while a client thread reads a 10 MB body."""

    def __init__(self, n: int) -> None:
        self._pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"))

    async def get(self, url: str, packed: bool = False, source: str = "") -> tuple[float, bytes]:
        """scrape(url, packed, source) in a client process."""
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, scrape, url, packed, source
        )

    def close(self) -> None:
        """Stop the client processes."""
        self._pool.shutdown(cancel_futures=True)


async def _steady_scraper(
    a: Agg, packed: bool, offset: float, plan: Plan, t0: float, clients: Clients
) -> None:
    """Scrape `a` every plan.interval_s from t0 + offset, as Prometheus does."""
    key = "steady_gz" if packed else "steady"
    for k in range(plan.steady):
        await asyncio.sleep(max(0.0, t0 + offset + k * plan.interval_s - time.monotonic()))
        took_s, body = await clients.get(a.url, packed)
        if k >= LEARN:
            a.fig.times[key].append(took_s)
        a.fig.keep(body, packed)


def _turn(aggs: list[Agg], k: int) -> list[Agg]:
    """The aggregators in their k-th order: each goes first in turn (k counts rounds of both
    encodings, so neither encoding always meets the same aggregator first)."""
    r = k % len(aggs)
    return aggs[r:] + aggs[:r]


async def measure(aggs: list[Agg], plan: Plan, srv: NatsServer) -> float:
    """Measure aggregators side by side; returns NATS bytes/s (in + out)."""
    clients = Clients(len(aggs))
    try:
        for a in aggs:
            wait_for_port(int(a.url.rsplit(":", 1)[1].split("/")[0]), 30)
        deadline = time.monotonic() + 90
        for a in aggs:  # warm-up: every stream seen (fast polls: rendered on request)
            while time.monotonic() < deadline:
                await asyncio.sleep(1.0)
                _, body = await clients.get(a.url)
                if body.count(b"\nkvobserve_stream_up{") >= a.fig.streams:
                    break
        await asyncio.sleep(1.5)
        c0 = [cpu_seconds(a.proc.pid) for a in aggs]
        v0, t0 = srv.varz(), time.monotonic()
        await asyncio.sleep(plan.idle_s)
        idle = time.monotonic() - t0
        v1 = srv.varz()
        for a, c in zip(aggs, c0, strict=True):
            a.fig.idle_cores = (cpu_seconds(a.proc.pid) - c) / idle
            a.fig.times = {
                k: [] for k in ("steady", "steady_gz", "cold", "cold_gz", "warm", "warm_gz")
            }
        # steady: one scraper per aggregator (one Prometheus asks for one format), plain then
        # gzip; the aggregators' phases spread over the interval
        c0 = [cpu_seconds(a.proc.pid) for a in aggs]
        s0 = [served(a.url) for a in aggs]
        t0 = time.monotonic()
        for packed in (False, True):
            start = time.monotonic() + 0.5
            await asyncio.gather(
                *(
                    _steady_scraper(
                        a, packed, i * plan.interval_s / len(aggs), plan, start, clients
                    )
                    for i, a in enumerate(aggs)
                )
            )
            await asyncio.sleep(plan.interval_s)  # the last renders ahead are over
        took = time.monotonic() - t0
        for a, c, s in zip(aggs, c0, s0, strict=True):
            extra = cpu_seconds(a.proc.pid) - c - a.fig.idle_cores * took
            a.fig.steady_cpu = extra / (2 * plan.steady)
            a.fig.served = {k: int(n - s[k]) for k, n in served(a.url).items() if k in SERVED}
        for i in range(2 * plan.cold):  # one-off: a new address each (127.0.1.x), never steady
            packed = i % 2 == 1
            await asyncio.sleep(1.5)  # every collector has sent a new snapshot
            source = f"127.0.{1 + i // 200}.{1 + i % 200}"
            for a in _turn(aggs, i // 2):
                before = served(a.url)
                c, t = cpu_seconds(a.proc.pid), time.monotonic()
                took_s, body = await clients.get(a.url, packed, source)
                f = a.fig
                f.cold_cpu.append(
                    cpu_seconds(a.proc.pid) - c - f.idle_cores * (time.monotonic() - t)
                )
                after = served(a.url)
                if after["renders"] - before["renders"] == 1:  # this request's render only
                    f.cold_render_cpu.append(
                        after["render_cpu_s"]
                        - before["render_cpu_s"]
                        + after["view_cpu_s"]
                        - before["view_cpu_s"]
                    )
                f.times["cold_gz" if packed else "cold"].append(took_s)
                f.keep(body, packed)
        for i in range(2 * plan.warm):
            for a in _turn(aggs, i // 2):
                took_s, _ = await clients.get(a.url, i % 2 == 1)
                a.fig.times["warm_gz" if i % 2 else "warm"].append(took_s)
    finally:
        clients.close()
        for a in aggs:
            stop_process(a.proc)
    moved = (v1["in_bytes"] - v0["in_bytes"]) + (v1["out_bytes"] - v0["out_bytes"])
    return moved / idle


def _percentile(key: str, q: float) -> Callable[[Figures], float]:
    return lambda f: f.p(key, q)


def report(title: str, figs: dict[str, Figures], nats_bps: float) -> None:
    """Each aggregator's figures side by side (and main/new when both were measured)."""
    print(f"{title}; NATS {nats_bps / 1e6:.2f} MB/s (in + out); load {_load()}")
    names = list(figs)
    ratio = len(names) == 2 and "shard 0" not in names
    rows: list[tuple[str, Callable[[Figures], float], str]] = [
        ("streams", lambda f: f.streams, "{:,.0f}"),
        ("/metrics MB plain", lambda f: f.plain_bytes / 1e6, "{:.2f}"),
        ("/metrics MB gzip", lambda f: f.gzip_bytes / 1e6, "{:.2f}"),
        ("samples per stream", lambda f: f.samples / max(f.streams, 1), "{:.1f}"),
    ]
    for key, what in (("steady", "steady plain"), ("steady_gz", "steady gzip"),
                      ("cold", "one-off plain"), ("cold_gz", "one-off gzip"),
                      ("warm", "back-to-back plain"), ("warm_gz", "back-to-back gzip")):  # fmt: skip
        for q, qn in ((0.5, "p50"), (0.99, "p99")):
            rows.append((f"{what} {qn} ms", _percentile(key, q), "{:.0f}"))
    rows += [
        ("steady: served ahead", lambda f: f.served["ahead"], "{:.0f}"),
        ("steady: waited for a render", lambda f: f.served["in_flight"], "{:.0f}"),
        ("steady: rendered on request", lambda f: f.served["on_request"], "{:.0f}"),
        ("CPU s per steady scrape", lambda f: f.steady_cpu, "{:.3f}"),
        ("CPU s per one-off scrape", lambda f: median(f.cold_cpu), "{:.3f}"),
        ("  of it view + render (thread CPU)", lambda f: median(f.cold_render_cpu), "{:.3f}"),
        ("idle CPU (intake), cores", lambda f: f.idle_cores, "{:.3f}"),
        ("cores at a 15 s scrape interval", lambda f: f.cores_at_15s, "{:.3f}"),
    ]
    head = "".join(f"{n[-10:]:>10s}" for n in names)
    print(f"  {'':34s}{head}" + (f"  {names[0]}/{names[1]}" if ratio else ""))
    for label, get, fmt in rows:
        vals = [get(figs[n]) for n in names]
        line = f"  {label:34s}" + "".join(f"{fmt.format(v):>10s}" for v in vals)
        if ratio:
            line += f"{vals[0] / vals[1]:9.1f}x" if vals[1] else "        -"
        print(line)


def _load() -> str:  # the machine's load average (1, 5, 15 min)
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _mine(collectors: int, shard: int, shards: int) -> int:
    """Collectors of the fleet whose worker is in the shard."""
    return sum(
        1 for c in range(collectors) if worker_bucket(f"sglang-{c // 2:03d}") % shards == shard
    )


async def run(
    collectors: int, ranks: int, plan: Plan, workdir: Path, shards: int = 1
) -> dict[int, dict[str, Figures]]:
    """Main's and this renderer side by side at a quarter and the whole fleet (shards == 1),
    or `shards` sharded aggregators over the whole fleet; one nats-server."""
    out: dict[int, dict[str, Figures]] = {}
    sizes = [collectors] if shards > 1 else sorted({max(2, collectors // 4), collectors})
    with NatsServer(workdir / "nats.log") as srv:
        for n in sizes:
            stop = asyncio.Event()
            pub = asyncio.create_task(publish_fleet(srv.url, n, ranks, stop))
            try:
                if shards == 1:
                    aggs = [
                        start_aggregator(srv.url, r, n * ranks, workdir) for r in ("main", "new")
                    ]
                else:
                    aggs = [
                        start_aggregator(
                            srv.url, "new", _mine(n, i, shards) * ranks, workdir, i, shards
                        )
                        for i in range(shards)
                    ]
                load0 = _load()
                bps = await measure(aggs, plan, srv)
            finally:
                stop.set()
                await pub
            figs = {
                (a.name.split("-")[0] if shards == 1 else f"shard {i}"): a.fig
                for i, a in enumerate(aggs)
            }
            out[n * ranks], what = figs, f"{n} collectors x {ranks} ranks = {n * ranks} streams"
            report(
                f"{what}{f' over {shards} shards' if shards > 1 else ''} (load before {load0})",
                figs,
                bps,
            )
    return out


async def compare(
    against: Path, collectors: int, ranks: int, plan: Plan, workdir: Path, rounds: int
) -> list[dict[str, Figures]]:
    """This checkout's aggregator beside `against`'s (both with render-ahead), at the whole
    fleet, in `rounds` fresh pairs (each going first in turn); the medians over the rounds."""
    here = Path(__file__).resolve().parents[1]
    out: list[dict[str, Figures]] = []
    with NatsServer(workdir / "nats.log") as srv:
        stop = asyncio.Event()
        pub = asyncio.create_task(publish_fleet(srv.url, collectors, ranks, stop))
        try:
            for r in range(rounds):
                trees = [against.resolve(), here] if r % 2 == 0 else [here, against.resolve()]
                aggs = [
                    start_aggregator(srv.url, "new", collectors * ranks, workdir, tree=t)
                    for t in trees
                ]
                load0 = _load()
                bps = await measure(aggs, plan, srv)
                by_tree = {t: a.fig for t, a in zip(trees, aggs, strict=True)}
                figs = {against.resolve().name: by_tree[against.resolve()], "this": by_tree[here]}
                report(
                    f"round {r + 1}: {collectors * ranks} streams (load before {load0})", figs, bps
                )
                out.append(figs)
        finally:
            stop.set()
            await pub
    summary: dict[str, Figures] = {}
    for name in out[0]:
        f = Figures(out[0][name].streams)
        rs = [o[name] for o in out]
        f.plain_bytes, f.gzip_bytes, f.samples = rs[0].plain_bytes, rs[0].gzip_bytes, rs[0].samples
        f.fixed = {
            (k, q): median([x.p(k, q) for x in rs]) for k in rs[0].times for q in (0.5, 0.99)
        }
        f.idle_cores = median([x.idle_cores for x in rs])
        f.steady_cpu = median([x.steady_cpu for x in rs])
        f.served = {k: int(median([x.served[k] for x in rs])) for k in rs[0].served}
        f.cold_cpu = [median([median(x.cold_cpu) for x in rs])]
        f.cold_render_cpu = [median([median(x.cold_render_cpu) for x in rs])]
        summary[name] = f
    report(
        f"medians over {rounds} rounds (of each round's p50, p99 and CPU)",
        summary,
        0.0,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    """Measure and print; returns 0."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__)
    p.add_argument("--collectors", type=int, default=512)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--shards", type=int, default=1, help=f"sharded aggregators (1-{BUCKETS})")
    p.add_argument("--steady", type=int, default=10, help="scrapes per steady scraper")
    p.add_argument("--interval", type=float, default=3.0, help="steady scrape interval, s")
    p.add_argument("--cold", type=int, default=8, help="one-off scrapes per encoding")
    p.add_argument("--warm", type=int, default=20, help="back-to-back scrapes per encoding")
    p.add_argument("--idle", type=float, default=10.0, help="seconds of intake-only CPU")
    p.add_argument("--quick", action="store_true", help="a smoke run: 8 collectors, 2 scrapes")
    p.add_argument(
        "--against",
        metavar="CHECKOUT",
        type=Path,
        help="measure this checkout's aggregator beside CHECKOUT's (e.g. a worktree of main), "
        "both rendering ahead, at --collectors only, over --rounds fresh pairs",
    )
    p.add_argument("--rounds", type=int, default=3, help="with --against: pairs measured")
    p.add_argument("--serve", metavar="NATS_URL", help=argparse.SUPPRESS)
    p.add_argument("--listen", help=argparse.SUPPRESS)
    p.add_argument("--renderer", choices=("main", "new"), default="new", help=argparse.SUPPRESS)
    p.add_argument("--shard", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        asyncio.run(
            serve_aggregator(args.serve, args.listen, args.renderer, args.shard, args.shards)
        )
        return 0
    if args.quick:
        args.collectors, args.steady, args.interval = 8 * args.shards, LEARN + 2, 1.0
        args.cold, args.warm, args.idle = 2, 2, 1.0
    plan = Plan(args.steady, args.interval, args.cold, args.warm, args.idle)
    print(f"python -m benchmarks.scale --collectors {args.collectors} --ranks {args.ranks} "
          f"--shards {args.shards} --steady {plan.steady} --interval {plan.interval_s:g} "
          f"--cold {plan.cold} --warm {plan.warm} --idle {plan.idle_s:g}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvobserve-scale-") as tmp:
        if args.against is not None:
            asyncio.run(
                compare(args.against, args.collectors, args.ranks, plan, Path(tmp), args.rounds)
            )
        else:
            asyncio.run(run(args.collectors, args.ranks, plan, Path(tmp), args.shards))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
