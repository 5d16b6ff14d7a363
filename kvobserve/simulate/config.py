"""The frozen configuration of one simulated worker (one engine node) and its layout rules."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvobserve.simulate import engines
from kvobserve.simulate.encoders import FORMATS, get_format
from kvobserve.simulate.engines.base import SimEngine
from kvobserve.simulate.faults import FaultConfig, faults_from_dict
from kvobserve.simulate.replay import ROUTES
from kvobserve.simulate.trace import TRACE_BLOCK_TOKENS
from kvobserve.simulate.wire_format import WireFormat

INDEXER_MODES = ("faithful", "lag", "lose_removals", "miss_worker")
DP_LB_MODES = ("internal", "hybrid")
EVENT_PLANES = ("nats", "zmq")


@dataclass(frozen=True)
class SimConfig:
    """One simulated engine node: its wire format, DP layout, ports, workload and faults."""

    worker_id: str = "sim-0"
    format: str = "sglang-0.5.23"
    dp_size: int = 2  # DP ranks of the whole worker (all nodes)
    nnodes: int = 1
    node_rank: int = 0
    dp_attention: bool = True  # SGLang only: ranks split across nodes; else all on the leader
    host: str = "127.0.0.1"  # this node's address: its publishers and HTTP bind here only
    node_hosts: tuple[str, ...] = ()  # nodes_of: node k on node_hosts[k]; () = all on `host`
    kv_port: int = 0  # base KV PUB port, rank r on kv_port + r; 0 = a free range
    # the KV PUBs connect here instead of binding kv_port (rank r: port + r), as vLLM does with
    # a concrete host (`tcp://collector:5557`) and llm-d's central mode; None: they bind
    kv_connect: str | None = None
    replay_port: int | None = 0  # base replay ROUTER port; None = no replay; 0 = a free range
    http_port: int | None = 0  # /metrics and discovery; None = no HTTP; 0 = a free port
    # vLLM DP load balancing: "internal" (node 0's API server manages every rank, other nodes
    # are headless) or "hybrid" (every node runs an API server for its own ranks)
    dp_lb: str = "internal"
    follower_http: bool = False  # nodes_of: SGLang nodes >= 1 serve the engine's dummy server
    grpc_port: int | None = None  # SGLang launched with --grpc-port: /server_info lists sources
    load_port: int | None = None  # SGLang >= 0.5.19 load PUB base; None = off; 0 = a free range
    kv_metrics_endpoint: str | None = None  # SGLang KvMetrics PUSH connects here (consumer binds)
    topic: str = ""
    rate: float = 50.0  # batches per second per rank; <= 0 = as fast as possible
    max_batches: int = 0  # per rank and instance kind; 0 = unlimited
    start_delay_s: float = 0.0  # publish nothing this long after start (an engine warming up)
    buffer_steps: int = 10_000
    hwm: int = 100_000
    capacity_tokens: int = 16_384
    cpu_tier_tokens: int = 0  # a host tier (offload on eviction, onboard on a hit); 0 = none
    page_size: int = 16
    max_running_requests: int = 48
    prompts: int = 200
    prefixes: int = 8
    zipf_s: float = 1.1
    requests_per_batch: int = 1
    output_tokens: int = 48  # mean generated tokens per request (unique, never shared)
    flush_every: int = 0  # AllBlocksCleared every N batches; 0 = never
    side_interval_s: float = 0.5  # LoadStat / KvMetrics cadence
    seed: int = 0
    model_name: str = "sim-model"
    truth_path: str | None = None
    truth_interval_s: float = 0.0  # also write the truth file periodically; 0 = only at stop
    faults: FaultConfig = field(default_factory=FaultConfig)
    # Dynamo mode: publish as a Dynamo worker on its event plane (simulate/dynamo_worker.py)
    event_plane: str | None = None  # nats | zmq (direct); None: the engine's own ZMQ streams
    event_plane_url: str | None = None  # nats: the NATS server to publish to
    namespace: str = "dynamo"
    component: str = "backend"
    endpoint: str = "generate"
    dynamo_worker_id: int = 0  # 0: derived from seed and worker_id (the same on every node)
    indexer_port: int | None = None  # serve a simulated Dynamo KV indexer; 0 = a free port
    indexer_mode: str = "faithful"  # faithful | lag | lose_removals | miss_worker
    indexer_lag_events: int = 8  # lag: the last N events of every rank are not applied yet
    indexer_miss_worker: str = ""  # miss_worker: the (simulator) worker id the indexer lacks
    # trace replay (simulate/replay.py): requests from a Mooncake-format trace instead of the
    # prompt library, routed across every rank of the worker (all its nodes in this process)
    trace: str | None = None
    speed: float = 1.0  # trace time per wall second; 0 = as fast as it goes
    trace_seconds: float = 0.0  # replay only the trace's first S seconds; 0 = all of it
    route: str = "round_robin"  # round_robin | random | kv_aware
    decode_tokens_per_s: float = 20.0  # a request holds its pages output_length / this seconds
    # once the trace is replayed, the truth of one cache of each of these factors x the pool's
    # total capacity (every rank's capacity_tokens): the judge of the capacity curve
    truth_capacities: tuple[float, ...] = ()

    @property
    def wire(self) -> WireFormat:
        """The wire format object."""
        return get_format(self.format)

    @property
    def engine(self) -> SimEngine:
        """The engine the format belongs to (its simulator profile)."""
        return engines.engine(self.wire.engine)

    def validate(self) -> SimConfig:
        """Self, or ValueError naming the field and the bad value."""
        if self.format not in FORMATS:
            get_format(self.format)
        positive = ("dp_size", "nnodes", "buffer_steps", "hwm", "capacity_tokens", "page_size")
        for name in (
            *positive,
            "max_running_requests",
            "prompts",
            "prefixes",
            "requests_per_batch",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: {v!r} must be an integer >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank: {self.node_rank!r} is outside 0..{self.nnodes - 1}")
        for name in ("kv_port", "replay_port", "http_port", "load_port", "grpc_port"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 65535:
                raise ValueError(f"{name}: {v!r} is not a port")
        if self.kv_connect is not None:
            scheme, _, rest = self.kv_connect.partition("://")
            port = rest.rpartition(":")[2]
            if scheme != "tcp" or not port.isdigit() or not 0 < int(port) <= 65535 - self.dp_size:
                raise ValueError(f"kv_connect: {self.kv_connect!r} is not tcp://host:port")
            if self.kv_port:
                raise ValueError(f"kv_port: {self.kv_port} with kv_connect: the PUBs connect")
        if self.kv_port and self.kv_port + self.dp_size > 65535:
            raise ValueError(f"kv_port: {self.kv_port} + dp_size {self.dp_size} passes 65535")
        for name in ("max_batches", "flush_every", "output_tokens", "cpu_tier_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: {getattr(self, name)!r} must be >= 0")
        if self.cpu_tier_tokens and not self.wire.has_medium:
            raise ValueError(
                f"cpu_tier_tokens: format {self.format} has no medium field to name a CPU tier"
            )
        if self.load_port is not None and not self.has_load_pub:
            first = next((f for f in FORMATS.values() if f.load_pub), None)
            since = f"{engines.titles([first.engine])} >= {first.release}" if first else "none"
            raise ValueError(f"load_port: format {self.format} has no load publisher ({since})")
        if self.kv_metrics_endpoint is not None and not self.engine.kv_metrics:
            only = engines.titles([n for n, e in engines.ENGINES.items() if e.kv_metrics])
            raise ValueError(
                f"kv_metrics_endpoint: format {self.format} has no KvMetrics ({only} only)"
            )
        if self.grpc_port is not None and not self.engine.grpc:
            only = engines.titles([n for n, e in engines.ENGINES.items() if e.grpc])
            raise ValueError(f"grpc_port: format {self.format} has no gRPC mode ({only} only)")
        if self.dp_lb not in DP_LB_MODES:
            raise ValueError(f"dp_lb: {self.dp_lb!r} is not internal or hybrid")
        if self.node_hosts and len(self.node_hosts) != self.nnodes:
            raise ValueError(
                f"node_hosts: {len(self.node_hosts)} hosts for nnodes {self.nnodes}: "
                "give one host per node"
            )
        self.faults.validate(self.dp_size)
        self._validate_dynamo()
        self._validate_trace()
        return self

    def _validate_trace(self) -> None:
        for name in ("speed", "trace_seconds", "decode_tokens_per_s"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or v < 0:
                raise ValueError(f"{name}: {v!r} must be a number >= 0")
        if self.route not in ROUTES:
            raise ValueError(f"route: {self.route!r} is not {', '.join(ROUTES)}")
        for f in self.truth_capacities:
            if not isinstance(f, int | float) or isinstance(f, bool) or f <= 0:
                raise ValueError(f"truth_capacities: {f!r} must be a number > 0")
        if self.trace is None:
            if self.truth_capacities:
                raise ValueError("truth_capacities: needs a trace to replay")
            return
        if self.event_plane is not None:
            raise ValueError("trace: a replayed trace publishes on the engines' own streams, "
                             "not on a Dynamo event plane")  # fmt: skip
        if TRACE_BLOCK_TOKENS % self.page_size:
            raise ValueError(
                f"page_size: {self.page_size} must divide the trace's {TRACE_BLOCK_TOKENS}-token "
                "blocks (1, 2, 4, ... 512)"
            )

    def _validate_dynamo(self) -> None:
        if self.event_plane is not None and self.event_plane not in EVENT_PLANES:
            raise ValueError(f"event_plane: {self.event_plane!r} is not nats or zmq")
        if self.event_plane is None:
            if self.indexer_port is not None or self.faults.drop_event_ids:
                raise ValueError("indexer_port / faults.drop_event_ids: need event_plane")
            return
        if self.event_plane == "nats" and not self.event_plane_url:
            raise ValueError("event_plane_url: event_plane nats needs the NATS server URL")
        if self.wire.hash_kind == "bytes32":
            raise ValueError(f"format: {self.format} has 32-byte hashes; Dynamo carries u64 hashes")
        if self.indexer_mode not in INDEXER_MODES:
            raise ValueError(
                f"indexer_mode: {self.indexer_mode!r} is not {', '.join(INDEXER_MODES)}"
            )
        if self.indexer_lag_events < 0:
            raise ValueError(f"indexer_lag_events: {self.indexer_lag_events!r} must be >= 0")

    @property
    def has_load_pub(self) -> bool:
        """The format has the opt-in `load` PUB (SGLang >= 0.5.19)."""
        return self.wire.load_pub

    def hosted_ranks(self) -> list[int]:
        """The DP ranks whose publishers run on this node."""
        if self.engine.pure_dp_on_leader and not self.dp_attention:
            # pure DP: the DP controller and every rank's publisher live on the leader node
            return list(range(self.dp_size)) if self.node_rank == 0 else []
        per, extra = divmod(self.dp_size, self.nnodes)
        start = self.node_rank * per + min(self.node_rank, extra)
        return list(range(start, start + per + (1 if self.node_rank < extra else 0)))

    @property
    def http_role(self) -> str | None:
        """This node's HTTP server: "api", "stub" (SGLang's dummy server) or None (no HTTP)."""
        if self.http_port is None:
            return None
        if self.engine.followers == "stub":  # SGLang: nodes >= 1 serve the dummy server
            return "api" if self.node_rank == 0 else "stub"
        # vLLM with internal LB: nodes >= 1 run --headless, without an API server
        return "api" if self.node_rank == 0 or self.dp_lb == "hybrid" else None

    def managed_ranks(self) -> list[int]:
        """The DP ranks this node's vLLM API server manages (and lists in /kv_event_sources)."""
        return list(range(self.dp_size)) if self.dp_lb == "internal" else self.hosted_ranks()

    def port_offset(self, rank: int) -> int:
        """The engine's port offset for a rank (SGLang < 0.5.16 pure DP offsets every rank by 0)."""
        if self.wire.pure_dp_one_port and not self.dp_attention:
            return 0  # attn_dp_rank is 0 on every scheduler: ranks >= 1 fail to bind
        return rank


_FIELDS = {f.name for f in dataclasses.fields(SimConfig)}


def worker_from_dict(d: dict[str, Any], defaults: dict[str, Any] | None = None) -> SimConfig:
    """A validated SimConfig from a TOML `[[worker]]` table; unknown keys name themselves."""
    kw: dict[str, Any] = dict(defaults or {})
    for k, v in d.items():
        key = "worker_id" if k == "id" else k
        if key == "faults":
            kw["faults"] = faults_from_dict(v)
        elif key not in _FIELDS:
            raise ValueError(f"worker.{k}: unknown key")
        elif key in ("node_hosts", "truth_capacities"):
            kw[key] = tuple(v)
        else:
            kw[key] = v
    try:
        return SimConfig(**kw).validate()
    except TypeError as exc:
        raise ValueError(f"worker: {exc}") from None
