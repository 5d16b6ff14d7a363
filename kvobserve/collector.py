"""One node's collector: sources -> analysis -> a snapshot every interval -> transport.

The ZMQ ingest runs in its own thread (sources/kv_stream.py); everything else (discovery,
scheduler sources, the snapshot loop, HTTP) runs on the asyncio loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvobserve import __version__
from kvobserve.aio import cancel_and_wait
from kvobserve.config import Config, WorkerConfig
from kvobserve.sources.discovery import DiscoveredEngine, DiscoveryError, Rediscovery, discover
from kvobserve.sources.dynamo_drift import DriftPoller
from kvobserve.sources.dynamo_ingest import DynamoIngest
from kvobserve.sources.dynamo_plan import plan_dynamo
from kvobserve.sources.dynamo_streams import DynamoOptions
from kvobserve.sources.kv_stream import IngestLoop, IngestOptions
from kvobserve.sources.passthrough import relabel
from kvobserve.sources.plan import StreamSpec, WorkerPlan, plan_worker
from kvobserve.sources.scheduler import SchedulerSources
from kvobserve.wire.snapshot import (
    CollectorCounters,
    CollectorInfo,
    Family,
    Sample,
    SchedulerStats,
    Snapshot,
    SourceErrors,
    encode_snapshot,
    split_parts,
)

log = logging.getLogger(__name__)
MAX_PASSTHROUGH_SAMPLES = 20_000  # per collector snapshot


class SinkCounters(Protocol):
    """What a sink counts (kvobserve.transport.TransportCounters)."""

    @property
    def dropped(self) -> dict[str, int]:
        """Messages not sent, by reason."""
        ...


class SnapshotSink(Protocol):
    """Where snapshots go: any transport (kvobserve.transport) has these."""

    @property
    def counters(self) -> SinkCounters:
        """The sink's counters."""
        ...

    async def publish_snapshot(self, collector_id: str, data: bytes, bucket: int = -1) -> None:
        """Send one encoded snapshot part; a failed send is counted by the sink, never raised."""
        ...


class Collector:
    """Watches the configured workers and publishes a snapshot every interval."""

    def __init__(
        self,
        cfg: Config,
        transport: SnapshotSink,
        *,
        ingest: IngestOptions | None = None,
        dynamo: DynamoOptions | None = None,
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
        self._dynamo_options = dynamo
        self.dynamo: DynamoIngest | None = None  # engine = "dynamo" workers (docs/dynamo.md)
        self.drift: list[DriftPoller] = []
        self.plans: list[WorkerPlan] = []
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
        self.ingest = IngestLoop(self._replan(), self._ingest_options)
        self.ingest.start()
        for plan in self.plans:
            w = plan.worker
            if not plan.scheduler or not plan.dp_size:
                continue
            src = SchedulerSources(
                plan.scheduler,
                w.engine,
                allow_pickle=w.allow_pickle,
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
        await self._start_dynamo()
        self._task = asyncio.create_task(self._loop(), name="kvobserve-snapshots")

    async def _start_dynamo(self) -> None:
        """The Dynamo event planes and their drift pollers, when the config has any."""
        node = self.cfg.collector
        plans = [plan_dynamo(i, w, node) for i, w in enumerate(self.cfg.workers) if _dyn(w)]
        if not plans:
            return
        self.dynamo = DynamoIngest(plans, self._dynamo_options)
        self.dynamo.start()
        self.drift = [DriftPoller(p, self.dynamo) for p in plans if p.worker.indexer_url]
        for d in self.drift:
            await d.start()

    def _replan(self) -> list[StreamSpec]:
        """Plan every worker anew from the config and discovery; the streams to watch."""
        node = self.cfg.collector
        self.plans = [
            plan_worker(i, w, node, self._found.get(w.id))
            for i, w in enumerate(self.cfg.workers)
            if not _dyn(w)
        ]
        return [s for p in self.plans for s in p.watched]

    def _on_rediscovered(self, new: DiscoveredEngine, old: DiscoveredEngine | None) -> None:
        for w in self.cfg.workers:
            if w.url == new.url:
                self._found[w.id] = new
        specs = self._replan()
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
        streams, workers = ingest.streams, [p.info() for p in self.plans]
        dynamo: dict[str, Any] = {}
        if self.dynamo is not None:
            dyn = await asyncio.wrap_future(self.dynamo.stats())
            streams, workers = streams + dyn.streams, workers + dyn.workers
            sched += dyn.scheduler
            if dyn.refused_streams:
                refused["streams"] = refused.get("streams", 0) + dyn.refused_streams
            dynamo = {"dynamo": dyn.dynamo, "dynamo_planes": dyn.planes}
            polled = [d.stats() for d in self.drift]
            dynamo["drift"] = [x for results, _ in polled for x in results]
            dynamo["drift_sources"] = [source for _, source in polled]
        self._seq += 1
        return Snapshot(
            self.info,
            seq=self._seq,
            time=self._clock(),
            interval_s=self.cfg.collector.interval_s,
            workers=workers,
            streams=streams,
            unexpected=ingest.unexpected,
            scheduler=sched,
            scheduler_errors=errors,
            passthrough=passthrough,
            refused=refused,
            counters=CollectorCounters(
                ingest.messages_received,
                ingest.loop_errors,
                self.snapshots_published,
                dict(self.transport.counters.dropped),
            ),
            **dynamo,
        )

    async def publish_once(self) -> Snapshot:
        """Build and publish one snapshot."""
        snap = await self.snapshot()
        # One part per shard bucket of the workers (docs/scale.md): a shard of the aggregator
        # subscribes to its buckets only; one aggregator merges the parts again.
        for part in split_parts(snap):
            await self.transport.publish_snapshot(
                self.info.collector_id, encode_snapshot(part), part.bucket
            )
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
            await cancel_and_wait(self._task)
            self._task = None
        for r in self._rediscovery:
            await r.close()
        for src in self.scheduler.values():
            await src.close()
        for d in self.drift:
            await d.close()
        loop = asyncio.get_running_loop()
        if self.dynamo is not None:
            await loop.run_in_executor(None, self.dynamo.stop)
        if self.ingest is not None:
            await loop.run_in_executor(None, self.ingest.stop)


def _dyn(w: WorkerConfig) -> bool:
    return w.engine == "dynamo"


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
