"""What a collector watches, as typed plans built from the config and discovery; opens no socket.

`plan_worker` decides, for one configured worker on this node: every rank's KV-event stream
(configured endpoints win over advertised ones), the ranks this node owns, the probe ports past
the last rank, and the scheduler sources with the exact endpoints they connect to or bind.
`kvobserve check` prints these plans; the collector runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvobserve.analysis.layout import offset_endpoint, watched_ranks
from kvobserve.config import CollectorConfig, ConfigError, WorkerConfig
from kvobserve.sources.discovery import DiscoveredEngine
from kvobserve.wire.snapshot import WorkerInfo


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """One KV-event endpoint to watch."""

    worker_id: str
    dp_rank: int
    engine: str
    endpoint: str
    topic: str = ""
    replay_endpoint: str | None = None
    probe: bool = False  # a port past the worker's last rank: nothing should publish there

    @property
    def key(self) -> tuple[str, int]:
        """(worker_id, dp_rank)."""
        return (self.worker_id, self.dp_rank)


@dataclass(frozen=True, slots=True)
class SchedulerSpec:
    """One scheduler source: `endpoints[i]` serves `ranks[i]`; no ranks = the message says."""

    source: str  # metrics (URL scraped), load (SUB), kv_metrics (PULL we bind), fpm (SUB)
    endpoints: tuple[str, ...]
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class WorkerPlan:
    """Everything this node does for one worker."""

    worker: WorkerConfig
    dp_size: int  # 0: unknown until discovery answers
    streams: tuple[StreamSpec, ...]  # one per rank of the whole worker
    watched_ranks: tuple[int, ...]  # the ranks this node owns
    probes: tuple[StreamSpec, ...]
    scheduler: tuple[SchedulerSpec, ...]
    discovered_from: str | None = None
    notes: tuple[str, ...] = ()

    @property
    def watched(self) -> list[StreamSpec]:
        """The streams of the ranks this node owns, then its probes."""
        mine = set(self.watched_ranks)
        return [s for s in self.streams if s.dp_rank in mine] + list(self.probes)

    def info(self) -> WorkerInfo:
        """What the collector declares about this worker in its snapshots."""
        w = self.worker
        return WorkerInfo(
            w.id, w.engine, self.dp_size, list(self.watched_ranks), w.leader, w.capacity_tokens
        )


def rank_endpoint(base: str, rank: int, *, dotted_ipc: bool = False) -> str:
    """Rank r's side-channel endpoint: tcp port + r; ipc `{base}.{r}` (FPM) or `{base}` (shared)."""
    scheme, _, rest = base.partition("://")
    if scheme == "tcp":
        host, _, port = rest.rpartition(":")
        return f"tcp://{host}:{int(port) + rank}"
    return f"{base}.{rank}" if dotted_ipc else base


def scheduler_specs(
    w: WorkerConfig, ranks: range, load_base: str | None = None
) -> tuple[SchedulerSpec, ...]:
    """The scheduler sources of one worker for `ranks`; configured endpoints win over discovery.

    Without `metrics_url`, the engine's `url` + /metrics is scraped: SGLang and vLLM serve their
    Prometheus metrics on the same HTTP port as /server_info and /kv_event_sources.
    """
    out: list[SchedulerSpec] = []
    metrics_url = w.metrics_url or (f"{w.url.rstrip('/')}/metrics" if w.url else None)
    if metrics_url:
        out.append(SchedulerSpec("metrics", (metrics_url,)))
    load = w.load_endpoint or load_base
    if load:
        out.append(
            SchedulerSpec("load", tuple(rank_endpoint(load, r) for r in ranks), tuple(ranks))
        )
    if w.kv_metrics_endpoint:
        out.append(SchedulerSpec("kv_metrics", (w.kv_metrics_endpoint,)))
    if w.fpm_endpoint:
        eps = tuple(rank_endpoint(w.fpm_endpoint, r, dotted_ipc=True) for r in ranks)
        out.append(SchedulerSpec("fpm", eps, tuple(ranks)))
    return tuple(out)


def plan_worker(
    i: int, w: WorkerConfig, node: CollectorConfig, found: DiscoveredEngine | None
) -> WorkerPlan:
    """The plan of worker `i` on this node; ConfigError when a rank has no endpoint."""
    where = f"worker[{i}]"
    dp_size = w.dp_size or (found.dp_size if found else 1)
    notes = [] if w.dp_size or found else ["dp_size unknown without discovery; assuming 1"]
    if found and w.dp_size and w.dp_size != found.dp_size:
        notes.append(f"dp_size {w.dp_size} in config, the engine advertises {found.dp_size}")
    if found is None and not w.kv_endpoint:
        notes, dp_size = ["endpoints come from discovery at run time (--no-discovery)"], 0
    by_rank = {s.dp_rank: s for s in found.sources} if found else {}
    streams: list[StreamSpec] = []
    try:
        for r in range(dp_size):
            src = by_rank.get(r)
            ep = offset_endpoint(w.kv_endpoint, r, w.engine) if w.kv_endpoint else None
            replay = offset_endpoint(w.replay_endpoint, r, w.engine) if w.replay_endpoint else None
            if src is not None:  # configured endpoints win over advertised ones
                ep, replay = ep or src.endpoint, replay or src.replay_endpoint
            if ep is None:
                raise ConfigError(
                    f"{where}: no endpoint for dp_rank {r} (not advertised by {w.url})"
                )
            topic = w.topic or (src.topic if src else "")
            streams.append(StreamSpec(w.id, r, w.engine, ep, topic, replay))
        watched = (
            watched_ranks(w.engine, w.dp_attention, node.node_rank, node.nnodes, dp_size)
            if dp_size
            else range(0)
        )
        base = streams[0] if streams else None
        probe_eps = {
            dp_size + k: offset_endpoint(base.endpoint, dp_size + k, w.engine)
            for k in range(w.probe_extra_ports)
            if base is not None and base.endpoint.startswith("tcp://")
        }
    except ValueError as exc:  # layout refuses e.g. an ipc:// endpoint with several ranks
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{where}.kv_endpoint: {exc}") from None
    sched = scheduler_specs(w, range(dp_size), found.load_endpoint_base if found else None)
    # SGLang's `auto` load range starts at kv_base + dp_size: exactly the first probed port
    load_eps = {e for s in sched if s.source == "load" for e in s.endpoints}
    for r, ep in list(probe_eps.items()):
        if ep in load_eps:
            del probe_eps[r]
            notes.append(f"probe {ep} skipped: it is the SGLang load publisher's port")
    probes: tuple[StreamSpec, ...] = ()
    if base is not None and dp_size - 1 in watched:  # the node with the last rank probes past it
        probes = tuple(
            StreamSpec(w.id, r, w.engine, ep, base.topic, probe=True) for r, ep in probe_eps.items()
        )
    return WorkerPlan(
        w,
        dp_size,
        tuple(streams),
        tuple(watched),
        probes,
        sched if w.leader else (),
        found.url if found else None,
        tuple(notes),
    )
