"""The parts of an engine profile: what differs per engine, as data (docs/engines.md).

Each engine module (`sglang.py`, `vllm.py`, `dynamo.py`) declares one `EngineProfile`; the rest
of the tree asks `kvobserve.engines.profile(name)` for the part it needs and applies it
(analysis/layout.py the rank layout, sources/discovery.py the discovery routes,
sources/passthrough.py the metric names, wire/kv_view.py the event fields of every version,
config/ the worker keys) instead of comparing an engine's name. A profile imports nothing of
kvobserve: every layer, config included, can read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RankLayout:
    """Where an engine's DP ranks run and which port each publishes on."""

    # The engine has attention DP: its ranks are split over the nodes only with it, and a
    # scheduler then publishes as its attention-DP rank. `kvobserve check` shows it, and a
    # config that says otherwise than the engine is a layout mismatch.
    dp_attention: bool = False
    # Without attention DP every rank's scheduler runs on node 0 (the leader watches them all).
    pure_dp_on_leader: bool = False
    # The first version whose schedulers publish as their DP rank under pure DP; before it they
    # published as their attention-DP rank, 0 on every scheduler, so all collide on one port.
    # () = always the DP rank.
    dp_rank_selection: tuple[int, ...] = ()
    # Port 0 (chosen by the OS) is left alone when the endpoint is offset per rank.
    keeps_port_zero: bool = False


@dataclass(frozen=True, slots=True)
class Discovery:
    """Where an engine's HTTP server says what it publishes.

    sources/discovery.py asks `routes` in order (the next only after a 404) and parses the
    answer with the parser of that route (sources/discovery_parse.py `PARSERS`).
    """

    routes: tuple[str, ...]
    missing: str = ""  # added to a 404 on every route: what the operator does instead
    several_urls: bool = False  # several API servers, each listing its own ranks (merged)
    block_sizes: bool = False  # each rank's block size from the server's /metrics (cache_info)


@dataclass(frozen=True, slots=True)
class SchedulerMetrics:
    """The engine's Prometheus families that the scheduler values of a DP rank come from."""

    names: Mapping[str, str]  # sample name -> SchedulerValues field (the first sample wins)
    rank_label: str  # the label holding the DP rank (absent: rank 0)
    prefix_counters: tuple[str, ...] = ()  # (hits, queries) in tokens: the cache hit ratio
    # (hits, queries) in tokens of the whole worker, without a rank label (SGLang's tokenizer)
    worker_prefix_counters: tuple[str, ...] = ()
    cache_info: str = ""  # the info family with block_size and num_gpu_blocks labels


@dataclass(frozen=True, slots=True)
class WireVersion:
    """One released version's KV events as they are on the wire.

    `stored` and `removed` name the fields of BlockStored and BlockRemoved in wire order (after
    the tag); `{a, b}` is an element that is a map holding fields a and b. The decoder
    (wire/kv_events.py) reads every version by its shape; `kvobserve tap` names each field by
    these lists (wire/kv_view.py); tests tie every version to its capture and to the
    simulator's format of the same version.
    """

    version: str
    form: str  # "array" (tagged arrays), "map" (tagged maps) or the event plane's form
    stored: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    replay: str = ""  # the replay reply: "3 frames", "4 frames, with topic" or "none"
    hashes: tuple[str, ...] = ()  # int64 (signed), uint64, bytes32
    captures: tuple[str, ...] = ()  # folders under tests/fixtures with this version's bytes
    note: str = ""

    @property
    def names(self) -> tuple[str, ...]:
        """Every field name of both events, map elements opened."""
        return tuple(dict.fromkeys(n for f in (*self.stored, *self.removed) for n in opened(f)))


def opened(name: str) -> tuple[str, ...]:
    """`{a, b}` -> (a, b); a plain field name -> (name,)."""
    if name.startswith("{"):
        return tuple(x.strip() for x in name.strip("{}").split(","))
    return (name,)


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """Everything kvobserve knows about one engine that is not the same for all engines."""

    name: str  # `[[worker]] engine`, the `engine` label
    title: str  # as people write it, in messages and docs
    # How its KV events arrive: from an event plane (Dynamo's NATS or ZMQ, its own ingest,
    # sources/dynamo_*.py) instead of one ZMQ PUB per DP rank (sources/kv_stream.py).
    event_plane: bool = False
    pods: bool = False  # a `[worker.kubernetes]` label selector may find its pods
    layout: RankLayout | None = None  # None: the event plane names each stream's rank
    discovery: Discovery | None = None  # None: nothing to ask over HTTP
    metrics: SchedulerMetrics | None = None  # None: no /metrics scrape
    metrics_path: str = "/metrics"  # on the discovery URL's port, when no metrics_url is given
    default_endpoint: str = ""  # the KV-event endpoint the engine binds when its config names none
    default_namespace: str = ""  # an event plane's namespace when the deployment names none
    signed_hashes: bool = False  # block hashes are signed int64 (placement shifts them by 2^63)
    # its BlockStored events name full blocks only (a block an index lacks holds a whole block's
    # tokens: analysis/vouch.py); else a sequence's last page may be short (SGLang)
    full_blocks_only: bool = False
    # How its top tier evicts, in words, and whether that follows recency (an LRU of blocks or of
    # radix leaves): only then are its evicted blocks, in eviction order, the LRU stack below
    # its capacity, which the capacity curve reads (analysis/capacity.py). False: the curve
    # says it is not available, and why, instead of a number.
    eviction: str = ""
    recency_eviction: bool = False
    versions: tuple[WireVersion, ...] = ()

    @property
    def several_urls(self) -> bool:
        """Whether a worker may name several HTTP servers (`url` as a list)."""
        return self.discovery is not None and self.discovery.several_urls
