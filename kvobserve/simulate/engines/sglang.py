"""SGLang as the simulator plays it: its event structs and formats per version, the facts of each
version (routes, `/server_info` parts, the load publisher, the pure-DP port rule) and its
scheduler metrics. Facts from each released wheel: `disaggregation/kv_events.py`,
`entrypoints/http_server.py`, `utils/common.py`, `metrics/collector.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from msgspec import Struct
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvobserve.simulate.engines.base import NodeMetrics, SimEngine
from kvobserve.simulate.wire_format import (
    NO_META,
    RemoveFn,
    RemoveMeta,
    StoreFn,
    StoreMeta,
    WireFormat,
    removed2,
    shares,
    stored6,
)
from kvobserve.simulate.wire_structs import (
    ClearedArr,
    ClearedMap,
    Hash,
    TokenIds,
)

ROOT_PARENT_047 = 5740354900026072187  # hash(()) in CPython: 0.4.7 hashes the root's empty key
LOAD_STAT_FULL = (5, 20)  # LoadStat's 11-element form; 0.5.19's has 6 (sidechannels.py)

# --- the structs of 0.5.12 (0.5.10-0.5.16) and 0.5.19 (0.5.18-0.5.19): + medium -------------


class Stored7(Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: TokenIds
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class CacheSaltMeta(Struct, omit_defaults=True, gc=False):
    cache_salt: str | None = None


class Stored8Salt(Struct, array_like=True, tag="BlockStored", gc=False):
    """0.5.18/19 `BlockStoredWithMetadata`: element 7 is a `{"cache_salt": ...}` map."""

    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: TokenIds
    block_size: int
    lora_id: int | None
    medium: str | None
    metadata: CacheSaltMeta


class Removed3(Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[Hash]
    medium: str | None = None


# --- 0.5.23 (0.5.20+): tagged map, None optionals omitted -----------------------------------


class StoredS23(Struct, omit_defaults=True, tag_field="type", tag="BlockStored", gc=False):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: TokenIds
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class RemovedS23(Struct, omit_defaults=True, tag_field="type", tag="BlockRemoved", gc=False):
    block_hashes: list[Hash]
    medium: str | None = None


def _s_arr7(
    h: list[Hash], p: Hash | None, t: TokenIds, bs: int, m: str | None, x: StoreMeta
) -> Any:
    return Stored7(h, p, t, bs, x.lora_id, m)


def _s_s19(h: list[Hash], p: Hash | None, t: TokenIds, bs: int, m: str | None, x: StoreMeta) -> Any:
    if x.cache_salt is not None:
        return Stored8Salt(h, p, t, bs, x.lora_id, m, CacheSaltMeta(x.cache_salt))
    return Stored7(h, p, t, bs, x.lora_id, m)


def _s_s23(h: list[Hash], p: Hash | None, t: TokenIds, bs: int, m: str | None, x: StoreMeta) -> Any:
    return StoredS23(h, p, t, bs, x.lora_id, m, x.cache_salt, x.session_id, x.lora_name)


def _r_arr3(h: list[Hash], m: str | None, x: RemoveMeta) -> Any:
    return Removed3(h, m)


def _r_s23(h: list[Hash], m: str | None, x: RemoveMeta) -> Any:
    return RemovedS23(h, m)


def _meta(fmt: WireFormat, n: int, tokens: Sequence[Any], block_size: int) -> StoreMeta:
    """A session, a cache salt and a LoRA name, where the version has each."""
    s, fields = shares(fmt.meta_fields, n), fmt.meta_fields
    if s is None:
        return NO_META
    return StoreMeta(
        cache_salt=s.salt if "cache_salt" in fields else None,
        session_id=s.session,
        lora_name="sql-lora" if s.lora and "lora_name" in fields else None,
    )


# the parts of /server_info and the first version that has each (simulate/discovery.py)
_SERVER_INFO_SINCE = {
    "kv_events": (5, 13),  # the kv_events block of port bases
    "load_endpoint": (5, 19),  # ... with the load PUB's base, when one is launched
    "launch_command": (5, 21),  # resolved_dict() replaced asdict()
    "attn_dp_size": (5, 22),  # --dp-size N --enable-dp-attention: attn_dp_size N, dp_size 1
    "grpc": (5, 22),  # grpc_port, and kv_event_sources in gRPC mode
    "replay_base": (5, 22),  # replay_endpoint_port_base in the kv_events block
}


def _fmt(
    name: str,
    release: str,
    version: tuple[int, int],
    stored: StoreFn,
    removed: RemoveFn,
    cleared: Any,
    *,
    medium: bool,
    meta: str = "",
    per_node: bool = False,
    topic_replay: bool = False,
    root_parent: Hash | None = None,
) -> WireFormat:
    old = version < (5, 0)  # 0.4.7: only /get_server_info; no /metrics or /ping on followers
    health = ("/health", "/health_generate")
    return WireFormat(
        name, "sglang", release, version, stored, removed, cleared, _meta,
        frozenset(meta.split()), medium, "int64", "CPU_PINNED",
        api_routes=(*health, "/metrics", *(() if old else ("/server_info",)), "/get_server_info"),
        stub_routes=(*health, *(() if old else ("/metrics", "/ping"))),  # sglang #7720
        per_page_stores=True,
        removed_per_node=per_node,
        replay_with_topic=topic_replay,
        root_parent=root_parent,
        server_info=frozenset(k for k, since in _SERVER_INFO_SINCE.items() if version >= since),
        load_pub=version >= (5, 19),
        # before select_kv_publisher_dp_rank (0.5.16) every pure-DP scheduler publishes as its
        # attention-DP rank, 0: ranks >= 1 fail to bind the base port
        pure_dp_one_port=version < (5, 16),
    )  # fmt: skip


_S23_META = "cache_salt session_id lora_name"
FORMATS = (
    _fmt(
        "sglang-0.4", "0.4.7", (0, 4), stored6, removed2, ClearedArr(),
        medium=False, root_parent=ROOT_PARENT_047,
    ),
    _fmt("sglang-0.5.12", "0.5.12", (5, 12), _s_arr7, _r_arr3, ClearedArr(), medium=True),
    _fmt(
        "sglang-0.5.19", "0.5.19", (5, 19), _s_s19, _r_arr3, ClearedArr(),
        medium=True, meta="cache_salt", per_node=True,
    ),
    # 0.5.22 and 0.5.23 share the wire (maps, lora_name, topic in replay); they differ only in
    # what /server_info says, so 0.5.22 exists to simulate that version's discovery
    _fmt(
        "sglang-0.5.22", "0.5.22", (5, 22), _s_s23, _r_s23, ClearedMap(),
        medium=True, meta=_S23_META, per_node=True, topic_replay=True,
    ),
    _fmt(
        "sglang-0.5.23", "0.5.23", (5, 23), _s_s23, _r_s23, ClearedMap(),
        medium=True, meta=_S23_META, per_node=True, topic_replay=True,
    ),
)  # fmt: skip

_FAMILIES = {
    "num_running_reqs": "The number of running requests.",
    "num_queue_reqs": "The number of requests in the waiting queue.",
    "token_usage": "The token usage.",
    "num_used_tokens": "The number of used tokens.",
    "cache_hit_rate": "The prefix cache hit rate.",
    "max_total_num_tokens": "Maximum total number of tokens in the KV cache pool.",
    "page_size": "The page size of the KV cache.",
}
_LABELS = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank", "dp_rank"]


def metrics(n: NodeMetrics) -> list[Metric]:
    """`sglang:*` scheduler gauges, one series per scheduler of this node."""
    out = {k: GaugeMetricFamily(f"sglang:{k}", doc, labels=_LABELS) for k, doc in _FAMILIES.items()}
    for r in n.ranks:
        labels = [n.model_name, "unified", "0", "0", "0", str(r.rank)]
        used = r.held_tokens  # SGLang: total - available - evictable
        out["num_running_reqs"].add_metric(labels, r.running)
        out["num_queue_reqs"].add_metric(labels, r.waiting)
        out["token_usage"].add_metric(labels, used / n.capacity_tokens)
        out["num_used_tokens"].add_metric(labels, used)
        out["cache_hit_rate"].add_metric(labels, r.batch_hit_rate)  # the last prefill batch
        out["max_total_num_tokens"].add_metric(labels, n.capacity_tokens)
        out["page_size"].add_metric(labels, n.page_size)
    fams: list[Metric] = list(out.values())
    if n.api_totals is not None:  # the tokenizer's counters, on the node serving the API
        prompt = CounterMetricFamily(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", labels=["model_name"]
        )
        cached = CounterMetricFamily(
            "sglang:cached_tokens", "Number of cached prompt tokens.", labels=["model_name"]
        )
        prompt.add_metric([n.model_name], n.api_totals[0])
        cached.add_metric([n.model_name], n.api_totals[1])
        fams += [prompt, cached]
    return fams


SIM = SimEngine(
    name="sglang",
    title="SGLang",
    formats=FORMATS,
    pure_dp_on_leader=True,
    followers="stub",
    kv_metrics=True,
    grpc=True,
    metrics=metrics,
)
