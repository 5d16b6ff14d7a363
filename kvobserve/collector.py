"""One node's collector: sources -> analysis -> a snapshot every interval -> transport.

The ZMQ ingest runs in its own thread (sources/kv_stream.py); everything else (discovery,
scheduler sources, the snapshot loop, HTTP) runs on the asyncio loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from kvobserve import __version__
from kvobserve.checkcmd import worker_plan
from kvobserve.config import Config, ConfigError, add_config_flags, load_config, overrides_from_args
from kvobserve.sources.discovery import DiscoveredEngine, DiscoveryError, Rediscovery, discover
from kvobserve.sources.kv_stream import IngestLoop, IngestOptions, StreamSpec
from kvobserve.sources.passthrough import relabel
from kvobserve.sources.scheduler import SchedulerSources
from kvobserve.transport import Transport
from kvobserve.wire.snapshot import (
    CollectorInfo,
    Family,
    Sample,
    SchedulerStats,
    Snapshot,
    SourceErrors,
    WorkerInfo,
    encode_snapshot,
)

log = logging.getLogger(__name__)
MAX_PASSTHROUGH_SAMPLES = 20_000  # per collector snapshot


def plan_streams(
    cfg: Config, found: dict[str, DiscoveredEngine]
) -> tuple[list[StreamSpec], list[WorkerInfo], dict[str, int]]:
    """The streams and probes this node watches, what it declares per worker, dp_size per worker."""
    specs: list[StreamSpec] = []
    infos: list[WorkerInfo] = []
    sizes: dict[str, int] = {}
    for i, w in enumerate(cfg.workers):
        plan = worker_plan(i, w, cfg, found.get(w.id))
        watched: list[int] = plan["watched_ranks"]
        dp_size = plan["dp_size"] or 0
        sizes[w.id] = dp_size
        for s in plan["streams"]:
            if s["dp_rank"] in watched:
                specs.append(
                    StreamSpec(
                        w.id,
                        s["dp_rank"],
                        w.engine,
                        s["endpoint"],
                        s["topic"],
                        s["replay_endpoint"] or None,
                    )
                )
        if dp_size and dp_size - 1 in watched:  # the node with the last rank probes past it
            topic = plan["streams"][0]["topic"] if plan["streams"] else w.topic
            for k, ep in enumerate(plan["probe_endpoints"]):
                specs.append(StreamSpec(w.id, dp_size + k, w.engine, ep, topic, probe=True))
        infos.append(WorkerInfo(w.id, w.engine, dp_size, watched, w.leader, w.capacity_tokens))
    return specs, infos, sizes


class Collector:
    """Watches the configured workers and publishes a snapshot every interval."""

    def __init__(
        self,
        cfg: Config,
        transport: Transport,
        *,
        ingest: IngestOptions | None = None,
        clock: Callable[[], float] = time.time,
        observers: list[Callable[[Snapshot], object]] | None = None,
    ) -> None:
        self.cfg = cfg
        self.observers = observers or []  # called with every published snapshot
        self.transport = transport
        self._clock = clock
        c = cfg.collector
        self.info = CollectorInfo(
            c.id, c.node_rank, socket.gethostname(), clock(), cfg.cluster, __version__
        )
        self._ingest_options = ingest
        self.ingest: IngestLoop | None = None
        self.workers: list[WorkerInfo] = []
        self.scheduler: dict[str, SchedulerSources] = {}
        self._rediscovery: list[Rediscovery] = []
        self._found: dict[str, DiscoveredEngine] = {}
        self._task: asyncio.Task[None] | None = None
        self._seq = 0
        self.snapshots_published = 0
        self.last_snapshot: Snapshot | None = None
        # passthrough samples refused by the cap, cumulative (a counter): once per engine scrape
        self._passthrough_refused = 0
        self._passthrough_counted: dict[str, int] = {}  # worker -> the scrape last counted

    async def start(self) -> None:
        """Discover, open the streams, start the scheduler sources and the snapshot loop."""
        for w in self.cfg.workers:
            if not w.url:
                continue
            try:
                self._found[w.id] = await discover(w.url, w.engine)
            except DiscoveryError as exc:  # not up yet: configured endpoints, rediscovery later
                log.warning("%s", exc)
            self._rediscovery.append(
                Rediscovery(
                    w.url, w.engine, on_change=self._on_rediscovered, current=self._found.get(w.id)
                )
            )
        specs, self.workers, sizes = plan_streams(self.cfg, self._found)
        self.ingest = IngestLoop(specs, self._ingest_options)
        self.ingest.start()
        for w in self.cfg.workers:
            if not w.leader or not sizes.get(w.id):
                continue
            found = self._found.get(w.id)
            src = SchedulerSources(
                w,
                sizes[w.id],
                load_endpoint=found.load_endpoint_base if found else None,
                interval_s=self.cfg.collector.interval_s,
            )
            try:
                await src.start()
            except Exception as exc:  # e.g. the KvMetrics PULL address in use: report, go on
                log.warning("worker %s: scheduler sources: %s", w.id, exc)
                await src.close()
                continue
            self.scheduler[w.id] = src
        for r in self._rediscovery:
            await r.start()
        self._task = asyncio.create_task(self._loop(), name="kvobserve-snapshots")

    def _on_rediscovered(self, new: DiscoveredEngine, old: DiscoveredEngine | None) -> None:
        for w in self.cfg.workers:
            if w.url == new.url:
                self._found[w.id] = new
        specs, self.workers, _ = plan_streams(self.cfg, self._found)
        if self.ingest is not None:
            self.ingest.set_specs(specs)
        log.info("endpoints of %s changed; now watching %d streams", new.url, len(specs))

    async def snapshot(self) -> Snapshot:
        """The collector's state now."""
        assert self.ingest is not None, "start() first"
        ingest = await asyncio.wrap_future(self.ingest.stats())
        refused = dict(ingest.refused)
        sched: list[SchedulerStats] = []
        passthrough: list[Family] = []
        errors = [
            SourceErrors(wid, source, reason, n)
            for wid, src in self.scheduler.items()
            for (source, reason), n in sorted(src.errors().items())
        ]
        for wid, src in self.scheduler.items():
            for rank, v in sorted(src.values().items()):
                sched.append(
                    SchedulerStats(
                        wid,
                        rank,
                        v.source,
                        v.running_requests,
                        v.queued_requests,
                        v.token_usage_ratio,
                        v.cache_hit_ratio,
                        v.max_total_tokens,
                        v.updated_at,
                    )
                )
            wcfg = next(w for w in self.cfg.workers if w.id == wid)
            if wcfg.passthrough_engine_metrics and src.scrape is not None:
                extra = {"worker_id": wid, "node_rank": str(self.info.node_rank)}
                fams = _families(relabel(src.scrape.families, extra))
                room = MAX_PASSTHROUGH_SAMPLES - sum(len(f.samples) for f in passthrough)
                scrape_no = src.scrape.messages_total
                new_scrape = self._passthrough_counted.get(wid) != scrape_no
                self._passthrough_counted[wid] = scrape_no
                for fam in fams:  # an engine's /metrics can be large: keep the snapshot bounded
                    if len(fam.samples) > room:
                        self._passthrough_refused += len(fam.samples) if new_scrape else 0
                        continue
                    room -= len(fam.samples)
                    passthrough.append(fam)
        if self._passthrough_refused:
            refused["passthrough_samples"] = self._passthrough_refused
        self._seq += 1
        return Snapshot(
            self.info,
            seq=self._seq,
            time=self._clock(),
            interval_s=self.cfg.collector.interval_s,
            workers=list(self.workers),
            streams=ingest.streams,
            unexpected=ingest.unexpected,
            scheduler=sched,
            scheduler_errors=errors,
            passthrough=passthrough,
            refused=refused,
        )

    async def publish_once(self) -> Snapshot:
        """Build and publish one snapshot."""
        snap = await self.snapshot()
        await self.transport.publish_snapshot(self.info.collector_id, encode_snapshot(snap))
        self.snapshots_published += 1
        self.last_snapshot = snap
        for observe in self.observers:
            observe(snap)
        return snap

    async def _loop(self) -> None:
        interval = self.cfg.collector.interval_s
        next_at = time.monotonic()
        while True:
            try:
                await self.publish_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a failed snapshot is retried next interval, never fatal
                log.exception("snapshot failed (continuing)")
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    async def close(self) -> None:
        """Stop everything; idempotent."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for r in self._rediscovery:
            await r.close()
        for src in self.scheduler.values():
            await src.close()
        if self.ingest is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.ingest.stop)


def _families(metrics: list[Any]) -> list[Family]:
    return [
        Family(
            m.name,
            m.type,
            m.documentation,
            [Sample(s.name, dict(s.labels), float(s.value)) for s in m.samples],
        )
        for m in metrics
    ]


# --- `kvobserve collect` ----------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvobserve collect` (the config flags; --nats is required in file or flags)."""
    add_config_flags(parser)
    parser.add_argument(
        "--no-local-http", action="store_true", help="do not serve the collector's own /metrics"
    )


def run(args: argparse.Namespace) -> int:
    """`kvobserve collect -c FILE --nats URL`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        cfg = load_config(args.config, overrides_from_args(args), os.environ)
        if cfg.nats is None:
            raise ConfigError("nats.url: required by `collect` (--nats URL or [nats] url)")
    except ConfigError as exc:  # one line on stderr, as every other command does
        print(f"kvobserve collect: error: {exc}".replace("\n", " "), file=sys.stderr)
        return 2
    return asyncio.run(_collect(cfg, local_http=not args.no_local_http))


async def _collect(cfg: Config, local_http: bool) -> int:
    from kvobserve.aggregator import Aggregator, start_http
    from kvobserve.analysis.fleet import FleetState
    from kvobserve.transport.nats import NatsConnectError, NatsTransport

    assert cfg.nats is not None
    transport = NatsTransport.from_config(
        cfg.nats, cfg.cluster, f"kvobserve-collector-{cfg.collector.id}"
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await transport.connect()
    except NatsConnectError as exc:
        print(f"kvobserve collect: error: {exc}", file=sys.stderr)
        return 1
    local = Aggregator(FleetState())  # the node's own view: a fleet of one, fed directly
    collector = Collector(
        cfg, transport, observers=[lambda snap: local.fleet.update(snap, time.time())]
    )
    stop_http = None
    try:
        await collector.start()
        if local_http and cfg.collector.listen:
            try:
                stop_http = await start_http(local, cfg.collector.listen)
            except OSError as exc:
                log.warning("local /metrics not served: %s", exc)
        log.info("collector %s watching %d workers", cfg.collector.id, len(cfg.workers))
        await stop.wait()
    finally:
        await asyncio.wait_for(_shutdown(collector, transport, stop_http), 1.8)
    return 0


async def _shutdown(collector: Collector, transport: Transport, stop_http: Any) -> None:
    if stop_http is not None:
        await stop_http()
    await collector.close()
    await transport.close()
