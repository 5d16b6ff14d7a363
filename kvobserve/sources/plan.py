"""What a collector watches, as typed plans built from the config and discovery; opens no socket.

`plan_worker` decides, for one configured worker on this node: every rank's KV-event stream
(configured endpoints win over advertised ones), the ranks this node owns, the probe ports past
the last rank, and the scheduler sources with the exact endpoints they connect to or bind.
A wildcard host (`tcp://*:5557`) is the node that owns the rank: this node's own ranks are
connected at `[collector] host`, other nodes' ranks keep the wildcard (this node does not know
their addresses). A worker with `bind` is received by its leader, which binds one endpoint per
rank (`ListenSpec`) for the engines to connect to. `kvobserve check` prints these plans; the
collector runs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from kvobserve.analysis.layout import (
    bracket,
    endpoint_host,
    offset_endpoint,
    on_node,
    owned_ranks,
    rank_layout,
    splits_ranks,
    watched_ranks,
)
from kvobserve.config import WILDCARD_HOSTS, CollectorConfig, ConfigError, WorkerConfig
from kvobserve.config.bind import TopicTemplate, fill_pod, pod_url_fields
from kvobserve.config.kubernetes import pod_topic
from kvobserve.engines import profile
from kvobserve.sources.discovery_parse import DiscoveredEngine
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
    bound: bool = False  # bind mode: `endpoint` is what this collector binds; publishers connect

    @property
    def key(self) -> tuple[str, int]:
        """(worker_id, dp_rank)."""
        return (self.worker_id, self.dp_rank)


@dataclass(frozen=True, slots=True)
class ListenSpec:
    """One endpoint this collector binds for the publishers of one rank to connect to.

    With a topic template each publisher (pod) is its own stream, `{worker_id}/{pod}`, found as
    it sends; else the endpoint feeds the one stream (worker_id, dp_rank). `replay_endpoint` is
    this rank's (port + rank), `{pod_ip}` still in it; `relay_to` likewise.
    """

    worker_id: str
    dp_rank: int
    engine: str
    endpoint: str
    topic: str = ""
    replay_endpoint: str | None = None
    relay_to: str | None = None
    relay_queue: int = 10_000

    @property
    def key(self) -> tuple[str, int]:
        """(worker_id, dp_rank)."""
        return (self.worker_id, self.dp_rank)

    @property
    def template(self) -> TopicTemplate:
        """The topic, parsed (validated with the config)."""
        return TopicTemplate.parse(self.topic, f"{self.worker_id}.topic")


@dataclass(frozen=True, slots=True)
class SchedulerSpec:
    """One scheduler source: `endpoints[i]` serves `ranks[i]`; no ranks = the message says.

    `scope`: "rank" (a per-rank channel of this node's own ranks, on every node), "node" (this
    node's own engine HTTP, on every node), "leader" (read by the worker's leader only) or "pod"
    (a URL template read for each pod a topic template names, `{pod}`/`{pod_ip}` filled:
    `pod_scheduler`).
    """

    source: str  # metrics (URL scraped), load (SUB), kv_metrics (PULL we bind), fpm (SUB)
    endpoints: tuple[str, ...]
    ranks: tuple[int, ...] = ()
    scope: str = "leader"


@dataclass(frozen=True, slots=True)
class LayoutMismatch:
    """A setting the engine's own layout contradicts, with the fix (`kvobserve check` prints it,
    a collector raises the layout_mismatch condition when it moves ranks)."""

    setting: str  # nnodes, node_rank, dp_size, dp_attention
    what: str  # "the engine runs on 2 nodes, [collector] nnodes is 1"
    fix: str  # "set [collector] nnodes = 2 and run a collector on each node"

    @property
    def text(self) -> str:
        """What and the fix, in one line."""
        return f"{self.what}; {self.fix}"


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
    owners: tuple[int, ...] = ()  # node_rank owning each rank (the layout rule)
    dp_attention: bool = False
    block_size: int | None = None
    mismatches: tuple[LayoutMismatch, ...] = ()  # settings the engine's layout contradicts
    misplaced: bool = False  # ... so that this node's ranks differ from what the engine runs here
    elsewhere: tuple[int, ...] = ()  # ranks the config gives this node that the engine does not
    listens: tuple[ListenSpec, ...] = ()  # bind mode, on the worker's leader

    @property
    def pods(self) -> bool:
        """Bind mode with a topic template: the streams are the pods that send, `{id}/{pod}`."""
        return bool(self.listens) and self.listens[0].template.templated

    @property
    def watched(self) -> list[StreamSpec]:
        """The streams of the ranks this node owns, then its probes."""
        mine = set(self.watched_ranks)
        return [s for s in self.streams if s.dp_rank in mine] + list(self.probes)

    def info(self, state: str = "", reason: str = "", since: float = 0.0) -> WorkerInfo:
        """What the collector declares about this worker in its snapshots."""
        w = self.worker
        return WorkerInfo(
            w.id, w.engine, self.dp_size, list(self.watched_ranks), w.leader, w.capacity_tokens,
            state, reason, since, list(self.elsewhere), w.kv_bytes_per_token or 0,
            w.tier_tokens or 0,
        )  # fmt: skip


def rank_endpoint(base: str, rank: int, *, dotted_ipc: bool = False) -> str:
    """Rank r's side-channel endpoint: tcp port + r; ipc `{base}.{r}` (FPM) or `{base}` (shared)."""
    scheme, _, rest = base.partition("://")
    if scheme == "tcp":
        host, _, port = rest.rpartition(":")
        return f"tcp://{host}:{int(port) + rank}"
    return f"{base}.{rank}" if dotted_ipc else base


def node_url(url: str, host: str) -> str | None:
    """`url` at this node's `host` when its host is a wildcard (node-local); None otherwise."""
    parts = urlsplit(url)
    if (parts.hostname or "") not in WILDCARD_HOSTS:
        return None
    netloc = bracket(host) + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def scheduler_specs(
    w: WorkerConfig,
    ranks: range | tuple[int, ...],
    load_base: str | None = None,
    *,
    host: str = "127.0.0.1",
    leader: bool = True,
) -> tuple[SchedulerSpec, ...]:
    """The scheduler sources of one worker on this node; configured endpoints win over discovery.

    Per-rank channels (load, fpm) of this node's own `ranks` on every node, wildcard hosts at
    `host`; a `metrics_url` with a wildcard host is this node's own engine (every node); an
    explicit `metrics_url` and the KvMetrics PULL belong to the leader. Without `metrics_url`,
    the engine's (first) `url` + its profile's `metrics_path` is scraped by the leader: SGLang
    and vLLM serve their Prometheus metrics on the same HTTP port as their discovery routes.
    """
    out: list[SchedulerSpec] = []
    path = profile(w.engine).metrics_path
    metrics_url = w.metrics_url or (f"{w.urls[0].rstrip('/')}{path}" if w.urls else None)
    if metrics_url and pod_url_fields(metrics_url):  # each pod's, filled as the pods send
        if leader:
            out.append(SchedulerSpec("metrics", (metrics_url,), scope="pod"))
        metrics_url = None
    local = node_url(metrics_url, host) if metrics_url else None
    if metrics_url and local is None and leader:
        out.append(SchedulerSpec("metrics", (metrics_url,)))
    if local is not None:
        out.append(SchedulerSpec("metrics", (local,), scope="node"))
    ranks = tuple(ranks)
    load = w.load_endpoint or load_base
    if load and ranks:
        eps = tuple(on_node(rank_endpoint(load, r), host) for r in ranks)
        out.append(SchedulerSpec("load", eps, ranks, "rank"))
    if w.kv_metrics_endpoint and leader:
        out.append(SchedulerSpec("kv_metrics", (w.kv_metrics_endpoint,)))
    if w.fpm_endpoint and ranks:
        eps = tuple(on_node(rank_endpoint(w.fpm_endpoint, r, dotted_ipc=True), host) for r in ranks)
        out.append(SchedulerSpec("fpm", eps, ranks, "rank"))
    return tuple(out)


def _owners(engine: str, dp_attention: bool, nnodes: int, dp_size: int) -> tuple[int, ...]:
    """The node_rank that owns each rank (the layout rule); () while dp_size is unknown."""
    out = [0] * dp_size
    if dp_size and splits_ranks(engine, dp_attention):
        for k in range(nnodes):
            for r in owned_ranks(k, nnodes, dp_size):
                out[r] = k
    return tuple(out)


def _served_here(found: DiscoveredEngine, node: CollectorConfig) -> bool:
    """Whether the engine's HTTP server that answered discovery is on this node's `host`."""
    host = urlsplit(found.url.split(",")[0].strip()).hostname or ""
    return host == node.host.strip("[]")


def layout_mismatches(
    w: WorkerConfig, node: CollectorConfig, found: DiscoveredEngine | None
) -> list[LayoutMismatch]:
    """The settings of the config that the engine's own layout (discovery) contradicts."""
    if found is None:
        return []
    out: list[LayoutMismatch] = []
    n = found.nnodes
    if n and n != node.nnodes:
        each = " and run a collector on each node" if n > 1 else ""
        out.append(
            LayoutMismatch(
                "nnodes",
                f"the engine runs on {n} node{'s' if n > 1 else ''}, [collector] nnodes is "
                f"{node.nnodes}",
                f"set [collector] nnodes = {n}{each}",
            )
        )
    k = found.node_rank
    if k is not None and k != node.node_rank and _served_here(found, node):
        out.append(
            LayoutMismatch(
                "node_rank",
                f"{found.url} is the engine's node {k} and on this node's host {node.host}, "
                f"[collector] node_rank is {node.node_rank}",
                f"set [collector] node_rank = {k}",
            )
        )
    if w.dp_size and w.dp_size != found.dp_size:
        out.append(
            LayoutMismatch(
                "dp_size",
                f"the engine has {found.dp_size} DP rank{'s' if found.dp_size > 1 else ''}, "
                f"dp_size is {w.dp_size} in config",
                f"set dp_size = {found.dp_size} or leave it out (discovery gives it)",
            )
        )
    attn, said = found.dp_attention, w.dp_attention
    # on one node every rank is there either way: only several nodes make it matter
    if (
        rank_layout(w.engine).dp_attention
        and None not in (attn, said)
        and attn != said
        and (n or node.nnodes) > 1
    ):
        out.append(
            LayoutMismatch(
                "dp_attention",
                f"the engine runs {'with' if attn else 'without'} DP attention, "
                f"dp_attention is {str(said).lower()} in config",
                f"set dp_attention = {str(attn).lower()} or leave it out (discovery gives it)",
            )
        )
    return out


def engine_ranks(
    w: WorkerConfig, node: CollectorConfig, found: DiscoveredEngine, dp_attention: bool
) -> frozenset[int]:
    """The ranks the engine runs on this node by its own layout, as far as discovery tells it
    (what it does not tell, the config's settings fill in)."""
    nodes = found.nnodes or node.nnodes
    attn = dp_attention if found.dp_attention is None else found.dp_attention
    k = node.node_rank
    if found.node_rank is not None and _served_here(found, node):
        k = found.node_rank
    if k >= nodes:
        return frozenset()
    return frozenset(watched_ranks(w.engine, attn, k, nodes, found.dp_size))


def _layout_notes(
    w: WorkerConfig, node: CollectorConfig, mismatches: list[LayoutMismatch], split: bool
) -> list[str]:
    """What the config and the engine disagree on, and explicit hosts on a split worker."""
    notes = [m.text for m in mismatches]
    for key in ("kv_endpoint", "replay_endpoint", "load_endpoint", "fpm_endpoint"):
        ep = getattr(w, key)
        if split and node.nnodes > 1 and ep and endpoint_host(ep) not in (None, *WILDCARD_HOSTS):
            notes.append(
                f"{key} {ep}: every node connects to {endpoint_host(ep)}; a wildcard host "
                "(tcp://*:PORT) means each rank's own node"
            )
    return notes


def plan_bind(
    i: int, w: WorkerConfig, node: CollectorConfig, found: DiscoveredEngine | None
) -> WorkerPlan:
    """Bind mode: the worker's leader binds `bind` + r for every rank r; the engines connect.

    The engines' endpoint names one host, so one collector receives every rank: the leader.
    """
    assert w.bind is not None
    where = f"worker[{i}]"
    dp_size = w.dp_size or (found.dp_size if found else 1)
    pods = TopicTemplate.parse(w.topic, f"{where}.topic").templated
    listens: list[ListenSpec] = []
    streams: list[StreamSpec] = []
    try:
        for r in range(dp_size):
            ep = offset_endpoint(w.bind, r, w.engine)
            replay = offset_endpoint(w.replay_endpoint, r, w.engine) if w.replay_endpoint else None
            relay = offset_endpoint(w.relay_to, r, w.engine) if w.relay_to else None
            listens.append(ListenSpec(w.id, r, w.engine, ep, w.topic, replay, relay, w.relay_queue))
            if not pods:
                streams.append(StreamSpec(w.id, r, w.engine, ep, w.topic, replay, bound=True))
    except ValueError as exc:  # e.g. an ipc:// endpoint with several ranks
        raise ConfigError(f"{where}.bind: {exc}") from None
    notes = [*(found.notes if found else ())]
    if not w.leader:
        notes.append(f"bound by the worker's leader (node_rank 0 unless {where}.leader is set)")
    load_base = found.load_endpoint_base if found else None
    ranks = range(dp_size) if w.leader else range(0)
    return WorkerPlan(
        w,
        dp_size,
        tuple(streams),
        tuple(ranks),
        (),
        scheduler_specs(w, ranks, load_base, host=node.host, leader=w.leader),
        found.url if found else None,
        tuple(notes),
        (0,) * dp_size,
        False,
        found.block_size if found else None,
        listens=tuple(listens) if w.leader else (),
    )


def plan_worker(
    i: int, w: WorkerConfig, node: CollectorConfig, found: DiscoveredEngine | None
) -> WorkerPlan:
    """The plan of worker `i` on this node; ConfigError when a rank has no endpoint."""
    if w.bind is not None:
        return plan_bind(i, w, node, found)
    where = f"worker[{i}]"
    dp_size = w.dp_size or (found.dp_size if found else 1)
    notes = [] if w.dp_size or found else ["dp_size unknown without discovery; assuming 1"]
    if found is None and not w.kv_endpoint:
        notes, dp_size = ["endpoints come from discovery at run time (--no-discovery)"], 0
    dp_attention = w.dp_attention
    if dp_attention is None:
        dp_attention = bool(found and found.dp_attention)
    split = splits_ranks(w.engine, dp_attention)
    mismatches = layout_mismatches(w, node, found)
    notes += [*(found.notes if found else ()), *_layout_notes(w, node, mismatches, split)]
    by_rank = {s.dp_rank: s for s in found.sources} if found else {}
    watched: range | tuple[int, ...] = (
        watched_ranks(w.engine, dp_attention, node.node_rank, node.nnodes, dp_size)
        if dp_size
        else range(0)
    )
    # The engine's own layout wins over the config for what this node connects to: a rank it
    # runs elsewhere (or not at all) is no outage of ours; the collector raises layout_mismatch.
    here = engine_ranks(w, node, found, dp_attention) if found and mismatches else None
    misplaced = here is not None and here != set(watched)
    elsewhere: tuple[int, ...] = ()
    if misplaced and here is not None and found is not None and found.nnodes:  # SGLang says
        elsewhere = tuple(r for r in watched if r not in here)  # (a vLLM server may list a part)
        watched = tuple(r for r in watched if r in here)
    streams: list[StreamSpec] = []
    try:
        for r in range(dp_size):
            src = by_rank.get(r)
            ep = offset_endpoint(w.kv_endpoint, r, w.engine) if w.kv_endpoint else None
            replay = offset_endpoint(w.replay_endpoint, r, w.engine) if w.replay_endpoint else None
            if src is not None:  # configured endpoints win over advertised ones
                ep, replay = ep or src.endpoint, replay or src.replay_endpoint
            if ep is None:
                if found is not None and r >= found.dp_size:  # the dp_size mismatch says why
                    continue
                raise ConfigError(
                    f"{where}: no endpoint for dp_rank {r} (not advertised by {w.url})"
                )
            if r in watched:  # this node's rank: a wildcard host is this node
                ep, replay = on_node(ep, node.host), on_node(replay, node.host) if replay else None
            topic = w.topic or (src.topic if src else "")
            streams.append(StreamSpec(w.id, r, w.engine, ep, topic, replay))
        absent = [r for r in watched if r >= len(streams)]  # skipped ranks are the last ones
        if absent:  # configured ranks the engine does not have and advertises no endpoint for
            elsewhere = tuple(sorted({*elsewhere, *absent}))
            watched = tuple(r for r in watched if r not in absent)
        base = w.kv_endpoint or (by_rank[0].endpoint if 0 in by_rank else None)
        last = bool(streams) and dp_size - 1 in watched  # its node probes past the last rank
        probe_eps = {
            dp_size + k: on_node(offset_endpoint(base, dp_size + k, w.engine), node.host)
            for k in range(w.probe_extra_ports)
            if last and base is not None and base.startswith("tcp://")
        }
    except ValueError as exc:  # layout refuses e.g. an ipc:// endpoint with several ranks
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{where}.kv_endpoint: {exc}") from None
    load_base = found.load_endpoint_base if found else None
    sched = scheduler_specs(w, watched, load_base, host=node.host, leader=w.leader)
    # SGLang's `auto` load range starts at kv_base + dp_size: exactly the first probed port
    load = w.load_endpoint or load_base
    load_ports = range(0)
    if load and load.startswith("tcp://"):
        first = int(load.rpartition(":")[2])
        load_ports = range(first, first + dp_size)
    replays = {s.replay_endpoint: s.dp_rank for s in streams if s.replay_endpoint}
    for r, ep in list(probe_eps.items()):
        if int(ep.rpartition(":")[2]) in load_ports:
            del probe_eps[r]
            notes.append(f"probe {ep} skipped: it is the SGLang load publisher's port")
        elif ep in replays:  # llm-d's per-pod layout: events 5557 + r, replay 5559 + r
            del probe_eps[r]
            notes.append(f"probe {ep} skipped: it is rank {replays[ep]}'s replay port")
    topic0 = streams[0].topic if streams else ""
    probes = tuple(
        StreamSpec(w.id, r, w.engine, ep, topic0, probe=True) for r, ep in probe_eps.items()
    )
    return WorkerPlan(
        w,
        dp_size,
        tuple(streams),
        tuple(watched),
        probes,
        sched,
        found.url if found else None,
        tuple(notes),
        _owners(w.engine, dp_attention, node.nnodes, dp_size),
        dp_attention,
        found.block_size if found else None,
        tuple(mismatches),
        misplaced,
        elsewhere,
    )


def plan_pods(
    i: int, w: WorkerConfig, node: CollectorConfig, pods: Mapping[str, str], namespace: str
) -> list[WorkerPlan]:
    """The plans of a `[worker.kubernetes]` worker: one worker `{id}/{pod}` per streaming pod
    (name -> IP), whose rank r publishes at the pod's IP on `port` + r. A pod is one node: this
    collector watches every rank of it, whatever its own node_rank."""
    k = w.kubernetes
    assert k is not None, "a [worker.kubernetes] worker"
    one_node = dataclasses.replace(node, node_rank=0, nnodes=1)
    plans = []
    for name, ip in sorted(pods.items()):
        host = bracket(ip)
        pod = dataclasses.replace(
            w,
            id=f"{w.id}/{name}",
            metrics_url=fill_pod(w.metrics_url, name, ip) if w.metrics_url else None,
            kv_endpoint=f"tcp://{host}:{k.port}",
            replay_endpoint=f"tcp://{host}:{k.replay_port}" if k.replay_port else None,
            topic=pod_topic(k.topic, name, ip, namespace),
            kubernetes=None,
        )
        plans.append(plan_worker(i, pod, one_node, None))
    return plans


def pod_scheduler(plan: WorkerPlan, pod_worker_id: str) -> tuple[SchedulerSpec, ...]:
    """The scheduler sources of one pod (`{id}/{pod}`) a topic template named: the worker's
    per-pod ("pod") sources with `{pod}` and `{pod_ip}` filled, read as the pod's leader."""
    pod = pod_worker_id.removeprefix(f"{plan.worker.id}/")
    return tuple(
        SchedulerSpec(s.source, tuple(fill_pod(e, pod) for e in s.endpoints))
        for s in plan.scheduler
        if s.scope == "pod"
    )
