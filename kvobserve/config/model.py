"""The configuration model: one frozen dataclass per section; each default is declared here once."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from kvobserve import __version__

__all__ = [
    "COLLECT_DEFAULTS",
    "MAX_SHARDS",
    "SECTIONS",
    "AggregatorConfig",
    "CollectorConfig",
    "Config",
    "ConfigError",
    "HttpConfig",
    "KubernetesConfig",
    "NatsConfig",
    "WorkerConfig",
    "default_state_dir",
]


class ConfigError(ValueError):
    """A bad configuration value; the message names the field and the value (one line)."""


@dataclass(frozen=True, slots=True)
class CollectorConfig:
    """This node's collector; an empty `id` becomes the short hostname.

    `host`: where this collector reaches its own node's engines; a wildcard host in an endpoint
    (`tcp://*:5557`) means "the node that owns the rank", reached here. `state_dir`: where each
    stream's checkpoint is kept ("": the default, `default_state_dir`), written every
    `checkpoint_interval_s` (0: no checkpoints, none read either).
    """

    id: str = ""
    node_rank: int = 0
    nnodes: int = 1
    interval_s: float = 1.0
    host: str = "127.0.0.1"
    state_dir: str = ""
    checkpoint_interval_s: float = 5.0


def default_state_dir(env: Mapping[str, str], root: bool) -> str:
    """Where checkpoints go by default: /var/lib/kvobserve for root (a system service), else
    $XDG_STATE_HOME/kvobserve, else ~/.local/state/kvobserve (the image's user: in its home)."""
    if root:
        return "/var/lib/kvobserve"
    xdg = env.get("XDG_STATE_HOME", "")
    if os.path.isabs(xdg):  # the XDG spec: a relative value is invalid and ignored
        return os.path.join(xdg, "kvobserve")
    home = env.get("HOME") or os.path.expanduser("~")
    return os.path.join(home, ".local", "state", "kvobserve")


@dataclass(frozen=True, slots=True)
class KubernetesConfig:
    """`[worker.kubernetes]`: the worker's pods, found by a label selector and followed (list +
    watch, docs/kubernetes.md); each Ready pod is a worker `{id}/{pod name}` whose rank r
    publishes on `port` + r at the pod's IP."""

    selector: str = ""  # required: a label selector, as `kubectl get pods -l` takes it
    namespace: str = ""  # "": the client's (in a pod: its own, from its service account)
    port: int = 5557  # rank 0's KV-event PUB on every pod (llm-d's guides)
    replay_port: int = 0  # rank 0's replay ROUTER on every pod; 0: no replay
    topic: str = ""  # the subscription prefix; {pod}, {pod_ip} and {namespace} are the pod's
    kubeconfig: str = ""  # "": in a pod its service account, else $KUBECONFIG or ~/.kube/config


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One engine deployment (all its DP ranks); `dp_size` None = take it from discovery.

    `url`: one engine HTTP server, or several comma-separated (vLLM API servers that each list
    their own ranks); `dp_attention` None = from discovery, else false. With `bind` the worker's
    leader binds one endpoint per rank and the engines connect; `topic` may then be a template
    that names each publisher (config/topic.py).
    """

    id: str
    engine: str
    url: str | None = None
    kv_endpoint: str | None = None
    replay_endpoint: str | None = None
    topic: str = ""
    dp_size: int | None = 1
    dp_attention: bool | None = None
    metrics_url: str | None = None
    leader: bool = True
    capacity_tokens: int = 0
    probe_extra_ports: int = 1
    load_endpoint: str | None = None
    kv_metrics_endpoint: str | None = None
    fpm_endpoint: str | None = None
    allow_pickle: bool = False
    passthrough_engine_metrics: bool = False
    version: str | None = None
    # engine = "dynamo" only: Dynamo's KV event plane as the source (docs/dynamo.md)
    event_plane: str = "nats"  # nats (core NATS subjects) | zmq (direct PUB endpoints)
    event_plane_url: str | None = field(default=None, repr=False)  # nats://[user:pass@]host:port
    event_plane_creds: str | None = None
    event_plane_tls_ca: str | None = None
    event_plane_tls_cert: str | None = None
    event_plane_tls_key: str | None = None
    namespace: str | None = None  # None: every namespace the subscription sees
    zmq_endpoints: tuple[str, ...] = ()  # ZMQ direct: the publishers' advertised endpoints
    block_size: int = 0  # tokens per KV block (the wire has none); 0: token counts stay 0
    keep_ranks: str = "all"  # all | node (this node's contiguous share of dp_size)
    indexer_url: str | None = None  # a Dynamo KV indexer to measure router-index drift against
    indexer_api: str = "dump"  # dump (GET /dump: block sets) | query (POST /query: sizes only)
    indexer_model: str = ""  # the model of the dump groups / the /query model_name; "": all
    drift_interval_s: float = 30.0
    drift_lag_s: float = 1.0  # how far the router may trail (or lead) our index
    kubernetes: KubernetesConfig | None = None  # [worker.kubernetes]: pods found by a selector
    # bind mode (docs/deployment.md): this collector binds, the engines' publishers connect
    bind: str | None = None  # the endpoint bound for rank 0 (rank r: port + r); None: connect
    relay_to: str | None = None  # bind mode: every frame forwarded here first (rank r: port + r)
    relay_queue: int = 10_000  # frames waiting for the relay target; more are dropped (counted)
    # the miss split (docs/cache-analytics.md): the ranks a router could send a request to;
    # workers of one pool name it alike. "": the worker's own ranks (its id)
    pool: str = ""
    # the capacity curve (docs/cache-analytics.md "What more memory would buy"): the KV bytes
    # of one token (the curve's capacities in bytes too), an offload tier whose worth it says
    # (tokens), and its points below the capacity (a parent per resident block: opt-in)
    kv_bytes_per_token: int | None = None
    tier_tokens: int | None = None
    curve_below: bool = False

    @property
    def pool_id(self) -> str:
        """The worker's pool: `pool`, or its own id."""
        return self.pool or self.id

    @property
    def urls(self) -> tuple[str, ...]:
        """The engine HTTP servers to ask (discovery), in the order given."""
        return tuple(u.strip() for u in (self.url or "").split(",") if u.strip())


@dataclass(frozen=True, slots=True)
class NatsConfig:
    """NATS connection and auth; used by `collect` (publish) and `aggregate` (subscribe)."""

    url: str
    user: str | None = None
    password: str | None = field(default=None, repr=False)  # secrets stay out of logs
    token: str | None = field(default=None, repr=False)
    creds: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    jetstream_kv: bool = False
    connect_timeout_s: float = 5.0


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """The HTTP server of this process (/metrics, API, status page); `listen` "" = none."""

    listen: str = "127.0.0.1:9477"
    user: str | None = None  # basic auth on every route but /healthz
    password: str | None = field(default=None, repr=False)
    tls_cert: str | None = None  # PEM files: serve HTTPS
    tls_key: str | None = None
    # The runbook (docs/alerts.md) the status page and /api/v1/alerts link each condition to:
    # by default the installed version's (its tag), not the main branch's, whose sections may
    # have moved on; the rule file's runbook_url annotations name the same tag.
    runbook_url: str = f"https://github.com/kvobserve/kvobserve/blob/v{__version__}/docs/alerts.md"

    @property
    def basic_auth(self) -> tuple[str, str] | None:
        """(user, password) when basic auth is on."""
        return (self.user, self.password) if self.user and self.password else None

    @property
    def tls(self) -> tuple[str, str] | None:
        """(cert, key) when HTTPS is on."""
        return (self.tls_cert, self.tls_key) if self.tls_cert and self.tls_key else None


# `kvobserve collect` serves its node's own view on another port than the aggregator's (`run`,
# `aggregate`, `demo`: HttpConfig.listen), so both fit on one machine; [http] listen overrides it.
COLLECT_DEFAULTS = {"http.listen": "127.0.0.1:9478"}


@dataclass(frozen=True, slots=True)
class AggregatorConfig:
    """The fleet aggregator (`aggregate`, and the one inside `run` and `demo`)."""

    stale_intervals: float = 3.0
    otlp_endpoint: str | None = None
    per_stream_detail: bool = False  # per-stream histograms and block counters (series budget)
    shards: int = 1  # aggregators sharing the cluster, each serving its workers (docs/scale.md)
    shard: int = 0  # this aggregator's index, 0 .. shards - 1
    render_ahead_s: float = 2.0  # /metrics rendered before steady scrapers come; 0: on request
    # a rank whose index has not vouched for itself this long is a warning (index_incomplete)
    unvouched_warn_s: float = 600.0


MAX_SHARDS = 64  # = kvobserve.wire.snapshot.BUCKETS: a shard serves at least one bucket


@dataclass(frozen=True, slots=True)
class Config:
    """Everything one kvobserve process needs; `nats` None = the in-process bus."""

    cluster: str = "default"
    collector: CollectorConfig = field(default_factory=CollectorConfig)
    workers: tuple[WorkerConfig, ...] = ()
    aggregator: AggregatorConfig = field(default_factory=AggregatorConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    nats: NatsConfig | None = None
    path: str | None = None


def _spec(cls: type) -> dict[str, type]:
    """Key -> value type, read from a config dataclass (`int | None` -> int); a field holding
    another section's dataclass is a nested table, listed as its own section."""
    names = {"bool": bool, "int": int, "float": float, "tuple[str,": list}
    types = (str(f.type).split(" ")[0] for f in fields(cls))
    return {
        f.name: names.get(t, str)
        for f, t in zip(fields(cls), types, strict=True)
        if t not in _NESTED
    }


_NESTED = {"KubernetesConfig"}  # tables inside a section: `[worker.kubernetes]`


SECTIONS: dict[str, dict[str, type]] = {
    "": {"cluster": str},
    "collector": _spec(CollectorConfig),
    "worker": _spec(WorkerConfig),
    "worker.kubernetes": _spec(KubernetesConfig),  # a nested table: file only, no flags or env
    "aggregator": {**_spec(AggregatorConfig), "nats": str},  # nats: the [nats] url shorthand
    "http": _spec(HttpConfig),
    "nats": _spec(NatsConfig),
}
