"""One node's collector: sources -> analysis -> a snapshot every interval -> transport.

Every node reads the per-rank scheduler channels of its own ranks; the leader also reads the
worker-wide sources. A non-leader reports scheduler values of its own ranks only.

The ZMQ ingest runs in its own thread (sources/kv_stream.py); everything else (discovery,
scheduler sources, the snapshot loop, HTTP) runs on the asyncio loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from kvobserve import __version__
from kvobserve.aio import cancel_and_wait
from kvobserve.config import Config, WorkerConfig
from kvobserve.config import load as config_load
from kvobserve.engines import profile
from kvobserve.sources.capacity_stats import WorkerCurve
from kvobserve.sources.checkpoint_store import CheckpointStore, config_fingerprint
from kvobserve.sources.checkpoint_writer import CheckpointWriter
from kvobserve.sources.discovery import Rediscovery, discover_urls
from kvobserve.sources.discovery_parse import DiscoveredEngine, DiscoveryError
from kvobserve.sources.dynamo_drift import DriftPoller
from kvobserve.sources.dynamo_ingest import DynamoIngest
from kvobserve.sources.dynamo_plan import plan_dynamo
from kvobserve.sources.dynamo_state import DynamoOptions
from kvobserve.sources.health import OK_STATES, Health
from kvobserve.sources.ingest_options import IngestOptions
from kvobserve.sources.kubernetes import PodWatch
from kvobserve.sources.kv_stream import IngestLoop
from kvobserve.sources.passthrough import relabel
from kvobserve.sources.plan import (
    ListenSpec,
    SchedulerSpec,
    StreamSpec,
    WorkerPlan,
    plan_pods,
    plan_worker,
    pod_scheduler,
)
from kvobserve.sources.scheduler import SchedulerSources, SchedulerValues
from kvobserve.sources.stream_events import RecentEvents
from kvobserve.wire.errors import WireError
from kvobserve.wire.misses import decode_feedback
from kvobserve.wire.overlap import OverlapReply, decode_request, encode_overlap
from kvobserve.wire.parts import split_parts
from kvobserve.wire.snapshot import (
    CollectorCounters,
    CollectorInfo,
    Family,
    PrefixCounters,
    Sample,
    SchedulerStats,
    Snapshot,
    SourceErrors,
    SourceState,
    WorkerInfo,
    encode_snapshot,
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
        rediscovery_s: float = 30.0,
        pod_watch: dict[str, Any] | None = None,
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
        self._rediscovery_s = rediscovery_s  # how often discovery is asked again
        self.events = RecentEvents(wall=clock)  # every snapshot carries the latest
        self.ingest: IngestLoop | None = None
        self._dynamo_options = dynamo
        self.dynamo: DynamoIngest | None = None  # event-plane workers (docs/dynamo.md)
        self.drift: list[DriftPoller] = []
        self.plans: list[WorkerPlan] = []
        self.scheduler: dict[str, SchedulerSources] = {}
        self._rediscovery: list[Rediscovery] = []
        self._again: dict[str, Rediscovery] = {}  # by worker id
        self._worker_health: dict[str, Health] = {}  # by worker id: its state (worker_state)
        self._found: dict[str, DiscoveredEngine] = {}
        # [worker.kubernetes] workers: their pod watches (PodWatch options, e.g. for tests)
        self._pod_watch_options = pod_watch or {}
        self.pod_watches: dict[str, PodWatch] = {}
        self._sched_specs: dict[str, tuple[SchedulerSpec, ...]] = {}
        self._pods_seen: dict[str, list[str]] = {}  # [[worker]] id -> pods its topics named
        # each stream's engine KV capacity (tokens, read at: wall), as the last snapshot knew
        # it: what lets an incomplete index vouch for itself (analysis/vouch.py)
        self._capacities: dict[tuple[str, int], tuple[float, float]] = {}
        self._task: asyncio.Task[None] | None = None
        self._seq = 0
        self.snapshots_published = 0
        self.last_snapshot: Snapshot | None = None
        # passthrough samples refused by the cap, cumulative (a counter): once per engine scrape
        self._passthrough_refused = 0
        self._passthrough_counted: dict[str, int] = {}  # worker -> the scrape last counted
        self.feedback_errors: dict[str, int] = {}  # the aggregator's miss feedback, by reason

    async def start(self) -> None:
        """Discover, open the streams, start the scheduler sources and the snapshot loop."""
        todo = [w for w in self.cfg.workers if w.urls]
        # every worker at once: one engine that does not answer delays no other worker
        got = await asyncio.gather(
            *(discover_urls(w.urls, w.engine) for w in todo), return_exceptions=True
        )
        for w, found in zip(todo, got, strict=True):
            failed: DiscoveryError | None = None
            if isinstance(found, DiscoveryError):  # not up yet: configured endpoints, rediscovery
                log.warning("%s", found)
                failed = found
            elif isinstance(found, BaseException):
                raise found
            else:
                self._found[w.id] = found
            again = Rediscovery(
                w.urls,
                w.engine,
                interval_s=self._rediscovery_s,
                on_change=functools.partial(self._on_rediscovered, w.id),
                current=self._found.get(w.id),
            )
            again.last_error = failed  # logged once: the next polls log only a different error
            self._rediscovery.append(again)
            self._again[w.id] = again
        specs = self._replan()
        pools = {w.id: w.pool_id for w in self.cfg.workers}  # the miss split's pools
        curves = {w.id: WorkerCurve(w.capacity_tokens, w.curve_below) for w in self.cfg.workers}
        self.ingest = IngestLoop(specs, self._ingest_options, events=self.events,
                                 listens=self._listens(), pools=pools, curves=curves,
                                 checkpoints=self._checkpoints(), fingerprint=self._fingerprint)  # fmt: skip
        self.ingest.start()
        await self._sync_scheduler()
        for r in self._rediscovery:
            await r.start()
        for w in self.cfg.workers:  # pods come and go: their watch re-plans (sources/kubernetes.py)
            if w.kubernetes is not None:
                watch = PodWatch(
                    w.id,
                    w.kubernetes,
                    on_change=functools.partial(self._on_pods, w.id),
                    events=self.events,
                    **self._pod_watch_options,
                )
                self.pod_watches[w.id] = watch
                await watch.start()
        await self._start_dynamo()
        self._task = asyncio.create_task(self._loop(), name="kvobserve-snapshots")

    def _checkpoints(self) -> CheckpointWriter | None:
        """The writer of this collector's checkpoints, in its own folder of state_dir (one
        process per folder: a second collector of the same id on this host is refused there)."""
        c = self.cfg.collector
        if c.checkpoint_interval_s <= 0:
            return None
        # a Config built in code (the demo, an embedding) may leave it "": the default, as a
        # config file's does, never the working directory
        root = c.state_dir or config_load.state_dir("", os.environ)
        folder = Path(root) / _safe(self.cfg.cluster) / _safe(c.id)
        return CheckpointWriter(CheckpointStore(str(folder), self.events), c.checkpoint_interval_s)

    def _fingerprint(self, worker_id: str) -> str:
        """The fingerprint of the settings that shape a worker's (or pod's) index."""
        try:
            w: WorkerConfig | None = self._config_of(worker_id)
        except KeyError:
            w = None
        return config_fingerprint(self.cfg.cluster, w)

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

    def _source_changed(self, worker_id: str, source: str) -> Callable[[Health, str], None]:
        def changed(h: Health, before: str) -> None:
            if h.state in OK_STATES and before in OK_STATES:
                return  # waiting -> up is no news; moves into and out of trouble are
            msg = f"scheduler source {source}: {before} -> {h.state}: {h.reason}"
            self.events.add("source", msg, worker_id=worker_id, at=h.since)

        return changed

    def _replan(self) -> list[StreamSpec]:
        """Plan every worker anew from the config and discovery; the streams to watch."""
        node = self.cfg.collector
        self.plans = []
        for i, w in enumerate(self.cfg.workers):
            if _dyn(w):
                continue
            watch = self.pod_watches.get(w.id)
            if w.kubernetes is not None:  # one worker per streaming pod; none until listed
                if watch is not None:
                    self.plans += plan_pods(i, w, node, watch.streams, watch.namespace)
                continue
            self.plans.append(plan_worker(i, w, node, self._found.get(w.id)))
        return [s for p in self.plans for s in p.watched]

    def _listens(self) -> list[ListenSpec]:
        """The endpoints this collector binds (bind mode), as the last _replan() planned."""
        return [x for p in self.plans for x in p.listens]

    def _wanted_sources(self) -> dict[str, tuple[tuple[SchedulerSpec, ...], WorkerConfig]]:
        """The scheduler sources each worker should have: its plan's, and each pod's that a
        topic template named (its worker's "pod" sources, filled: the pods the ingest saw)."""
        out: dict[str, tuple[tuple[SchedulerSpec, ...], WorkerConfig]] = {}
        for plan in self.plans:
            w = plan.worker
            specs = tuple(s for s in plan.scheduler if s.scope != "pod") if plan.dp_size else ()
            out[w.id] = (specs, w)
            for pod in self._pods_seen.get(w.id, ()) if plan.pods else ():
                out[pod] = (pod_scheduler(plan, pod), w)
        return out

    async def _sync_scheduler(self) -> None:
        """Start the scheduler sources of every plan and pod; restart a worker's when its plan
        changed; close those of workers no longer planned (a deleted or forgotten pod)."""
        wanted = self._wanted_sources()
        for wid in [w for w in self._sched_specs if w not in wanted]:
            del self._sched_specs[wid]
            gone = self.scheduler.pop(wid, None)
            if gone is not None:
                await gone.close()
        for wid, (specs, w) in wanted.items():
            if self._sched_specs.get(wid) == specs:
                continue
            old = self.scheduler.pop(wid, None)
            if old is not None:
                await old.close()
            self._sched_specs[wid] = specs
            if not specs:
                continue
            src = SchedulerSources(
                specs,
                w.engine,
                allow_pickle=w.allow_pickle,
                interval_s=self.cfg.collector.interval_s,
                worker_id=wid,
            )
            for one in src.sources:
                one.health.on_change = self._source_changed(wid, one.name)
            try:
                await src.start()
            except Exception as exc:  # e.g. the KvMetrics PULL address in use: report, go on
                log.warning("worker %s: scheduler sources: %s", wid, exc)
                await src.close()
                continue
            self.scheduler[wid] = src

    async def _on_pods(self, worker_id: str, pods: dict[str, str]) -> None:
        """The streaming pods of a `[worker.kubernetes]` worker changed: re-plan, as rediscovery."""
        specs = self._replan()
        if self.ingest is not None:
            await asyncio.wrap_future(self.ingest.set_specs(specs))
        await self._sync_scheduler()
        log.info(
            "pods of %s: %d streaming; now watching %d streams", worker_id, len(pods), len(specs)
        )

    async def _on_rediscovered(
        self, worker_id: str, new: DiscoveredEngine, old: DiscoveredEngine | None
    ) -> None:
        self._found[worker_id] = new
        specs = self._replan()
        if self.ingest is not None:
            self.ingest.set_specs(specs, self._listens())
        await self._sync_scheduler()
        log.info("endpoints of %s changed; now watching %d streams", new.url, len(specs))

    def _capacity_of(
        self, sched: list[SchedulerStats]
    ) -> dict[tuple[str, int], tuple[float, float]]:
        """Each stream's KV capacity: `capacity_tokens` where configured (known all along),
        else what the engine's scheduler metrics said last, with when."""
        out = {
            (s.worker_id, s.dp_rank): (s.max_total_tokens, s.updated)
            for s in sched
            if s.max_total_tokens
        }
        for plan in self.plans:
            cap, wid = plan.worker.capacity_tokens, plan.worker.id
            if not cap:
                continue
            ids = self._pods_seen.get(wid, []) if plan.pods else [wid]  # each pod: its own engine
            ranks = range(plan.dp_size) if plan.pods else plan.watched_ranks
            out.update(((w, r), (float(cap), 0.0)) for w in ids for r in ranks)
        return out

    def _config_of(self, worker_id: str) -> WorkerConfig:
        """The config of a worker, a Kubernetes pod's (its plan's) or a topic-named pod's (its
        [[worker]]'s)."""
        for w in (*self.cfg.workers, *(p.worker for p in self.plans)):
            if w.id == worker_id:
                return w
        head, sep, _ = worker_id.rpartition("/")
        if not sep:
            raise KeyError(worker_id)
        return self._config_of(head)

    def _scheduler_values(
        self, worker_id: str, src: SchedulerSources
    ) -> dict[int, SchedulerValues]:
        """A rank's values as this node may report them: a non-leader reports its own ranks."""
        values = src.values()
        plan = next((p for p in self.plans if p.worker.id == worker_id), None)
        if plan is None or plan.worker.leader:
            return values
        mine = set(plan.watched_ranks)
        return {r: v for r, v in values.items() if r in mine}

    async def snapshot(self) -> Snapshot:
        """The collector's state now."""
        assert self.ingest is not None, "start() first"
        whole = frozenset(
            p.worker.id for p in self.plans if p.dp_size and len(p.watched_ranks) >= p.dp_size
        )
        ingest = await asyncio.wrap_future(self.ingest.stats(whole, self._capacities))
        if ingest.pods != self._pods_seen:  # pods a topic template named: their own sources
            self._pods_seen = ingest.pods
            await self._sync_scheduler()
        refused = dict(ingest.refused)
        sched: list[SchedulerStats] = []
        passthrough: list[Family] = []
        errors = [
            SourceErrors(wid, source, reason, n)
            for wid, src in self.scheduler.items()
            for (source, reason), n in sorted(src.errors().items())
        ]
        prefix = [p for wid, src in self.scheduler.items() for p in self._prefix(wid, src)]
        for wid, src in self.scheduler.items():
            for rank, v in sorted(self._scheduler_values(wid, src).items()):
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
            wcfg = self._config_of(wid)
            # a failed scrape's families are its last ones: passed through only while it is up
            if wcfg.passthrough_engine_metrics and src.scrape is not None and src.scrape.up:
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
        self._capacities = self._capacity_of(sched)
        if self._passthrough_refused:
            refused["passthrough_samples"] = self._passthrough_refused
        streams, workers = ingest.streams, self._worker_infos(ingest.pods)
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
            placement=ingest.placement,
            binds=ingest.binds,
            prefix=prefix,
            misses=ingest.misses,
            curves=ingest.curves,
            counters=CollectorCounters(
                ingest.messages_received,
                ingest.loop_errors,
                self.snapshots_published,
                dict(self.transport.counters.dropped),
            ),
            **dynamo,
            checkpoint=ingest.checkpoint,
            sources=self._source_states(),
            events=self.events.recent(),
        )

    def _prefix(self, worker_id: str, src: SchedulerSources) -> list[PrefixCounters]:
        """The engine's prefix-cache counters as this node may report them (as the values:
        a non-leader its own ranks only, never the worker's)."""
        got = src.prefix()
        plan = next((p for p in self.plans if p.worker.id == worker_id), None)
        if plan is not None and not plan.worker.leader:
            mine = set(plan.watched_ranks)
            got = {r: v for r, v in got.items() if r in mine}
        return [PrefixCounters(worker_id, r, h, q) for r, (h, q) in sorted(got.items())]

    async def on_feedback(self, data: bytes) -> None:
        """The aggregator's word on the miss split (levels, resyncs); bad bytes are counted."""
        try:
            fb = decode_feedback(data)
        except WireError as exc:
            self.feedback_errors[exc.reason] = self.feedback_errors.get(exc.reason, 0) + 1
            return
        if self.ingest is not None:
            await asyncio.wrap_future(self.ingest.follow(fb, self.info.collector_id))

    def _worker_infos(self, pods: dict[str, list[str]]) -> list[WorkerInfo]:
        """Every planned worker with its state now (docs/collector.md "Worker states"); with a
        topic template (bind mode), each of its pods that sent instead (every rank of a pod is
        bound here; the bound endpoint's own state stands for the worker)."""
        now = self._clock()
        out = []
        for p in self.plans:
            w = p.worker
            if p.pods:
                for pod in pods.get(w.id, ()):
                    ranks = list(p.watched_ranks)
                    info = WorkerInfo(pod, w.engine, p.dp_size, ranks, w.leader, w.capacity_tokens)
                    info.kv_bytes_per_token = w.kv_bytes_per_token or 0
                    info.tier_tokens = w.tier_tokens or 0
                    out.append(info)
                continue
            state, reason = self._worker_state(p)
            h = self._worker_health.get(w.id)
            if h is None:
                h = self._worker_health[w.id] = Health("", "", "", now, self._worker_changed(w.id))
            h.set(state, reason, now)
            out.append(p.info(h.state, h.reason, h.since))
        return out

    def _worker_state(self, p: WorkerPlan) -> tuple[str, str]:
        """(state, reason) of one worker: undiscovered, layout_mismatch or watching."""
        again = self._again.get(p.worker.id)
        err = again.last_error if again is not None else None
        if not p.streams and not p.listens:
            why = err.reason if err else f"no KV-event stream advertised by {p.worker.url}"
            return "undiscovered", why
        if p.misplaced:
            return "layout_mismatch", "; ".join(m.text for m in p.mismatches)
        reason = f"{len(p.watched_ranks)} of {p.dp_size} ranks on this node"
        return "watching", reason + (f"; discovery fails now: {err.reason}" if err else "")

    def _worker_changed(self, worker_id: str) -> Callable[[Health, str], None]:
        def changed(h: Health, before: str) -> None:
            if h.state == "watching" and before in ("", "watching"):
                return  # the normal start is no news
            level = logging.INFO if h.state == "watching" else logging.WARNING
            log.log(level, "worker %s: %s: %s", worker_id, h.state, h.reason)
            msg = f"{before} -> {h.state}: {h.reason}" if before else f"{h.state}: {h.reason}"
            self.events.add("worker", msg, worker_id=worker_id, at=h.since)

        return changed

    def _source_states(self) -> list[SourceState]:
        out = []
        for wid, watch in self.pod_watches.items():  # the selector's own state, pods or none
            h = watch.health
            n = watch.watch_events_total + watch.lists_total
            out.append(SourceState(wid, "kubernetes", watch.where, h.state, h.reason, h.since, n))
        for wid, src in self.scheduler.items():
            src.check_silence()  # a source that stopped sending is down, not "up: receiving"
            for s in src.sources:
                h = s.health
                where = ", ".join(s.endpoints)
                out.append(
                    SourceState(wid, s.name, where, h.state, h.reason, h.since, s.messages_total)
                )
        return out

    async def answer_overlap(self, data: bytes) -> bytes:
        """The answer to one overlap question (wire/overlap.py): for every rank of the asked
        workers this collector watches, the leading blocks of the request it holds now, walked
        in the ingest threads between two batches (docs/cache-analytics.md)."""
        info = self.info
        try:
            req = decode_request(data)
        except WireError as exc:
            return encode_overlap(OverlapReply(info.collector_id, info.node_rank, error=str(exc)))
        workers = frozenset(req.workers) if req.workers is not None else None
        asked = [
            x.overlap(req.hashes, workers) for x in (self.ingest, self.dynamo) if x is not None
        ]
        try:
            parts = await asyncio.gather(*map(asyncio.wrap_future, asked))
        except RuntimeError as exc:  # an ingest thread stopped (the collector is closing)
            return encode_overlap(OverlapReply(info.collector_id, info.node_rank, error=str(exc)))
        ranks = [r for part in parts for r in part]
        return encode_overlap(OverlapReply(info.collector_id, info.node_rank, ranks))

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
        for watch in self.pod_watches.values():
            await watch.close()
        for src in self.scheduler.values():
            await src.close()
        for d in self.drift:
            await d.close()
        loop = asyncio.get_running_loop()
        if self.dynamo is not None:
            await loop.run_in_executor(None, self.dynamo.stop)
        if self.ingest is not None:
            await loop.run_in_executor(None, self.ingest.stop)


def _safe(name: str) -> str:
    """A name as one path component."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip(".") or "_"


def _dyn(w: WorkerConfig) -> bool:
    """Whether the worker's events come from an event plane (Dynamo's), not per-rank PUBs."""
    return profile(w.engine).event_plane


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
