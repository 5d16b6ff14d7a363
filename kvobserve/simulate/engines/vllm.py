"""vLLM as the simulator plays it: its event structs and formats per version, the routes of its
API server and its scheduler metrics. Facts from each released wheel:
`vllm/distributed/kv_events.py`, the API server (`/kv_event_sources` from 0.31),
`vllm/v1/metrics/loggers.py`.
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

# --- 0.23 (0.22-0.23): 12-element tagged arrays ----------------------------------------------


class StoredV23(Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: TokenIds
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class RemovedV23(Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None


# --- 0.33: tagged map, 16 declared keys -> map16 header ----------------------------------------


class StoredV33(Struct, omit_defaults=True, tag_field="type", tag="BlockStored", gc=False):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: TokenIds
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None  # one list per block hash


class RemovedV33(Struct, omit_defaults=True, tag_field="type", tag="BlockRemoved", gc=False):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


def _group(x: StoreMeta | RemoveMeta) -> int:
    return 0 if x.group_idx is None else x.group_idx  # 0.21+ sends group 0 by default


def _s_v23(h: list[Hash], p: Hash | None, t: TokenIds, bs: int, m: str | None, x: StoreMeta) -> Any:
    return StoredV23(
        h, p, t, bs, x.lora_id, m, x.lora_name, x.extra_keys, _group(x), x.kv_cache_spec_kind,
        x.kv_cache_spec_sliding_window,
    )  # fmt: skip


def _s_v33(h: list[Hash], p: Hash | None, t: TokenIds, bs: int, m: str | None, x: StoreMeta) -> Any:
    return StoredV33(
        h, p, t, bs, x.lora_id, m, x.lora_name, x.extra_keys, _group(x), x.kv_cache_spec_kind,
        x.kv_cache_spec_sliding_window, x.locality, x.ownership, x.session_id,
        x.lookahead_token_ids,
    )  # fmt: skip


def _r_v23(h: list[Hash], m: str | None, x: RemoveMeta) -> Any:
    return RemovedV23(h, m, _group(x))


def _r_v33(h: list[Hash], m: str | None, x: RemoveMeta) -> Any:
    return RemovedV33(h, m, _group(x), x.locality, x.ownership)


def _meta(fmt: WireFormat, n: int, tokens: Sequence[Any], block_size: int) -> StoreMeta:
    """LoRA, a session, extra keys and lookahead tokens, where the version has each."""
    s, fields = shares(fmt.meta_fields, n), fmt.meta_fields
    if s is None:
        return NO_META
    n_blocks = len(tokens) // block_size if block_size else 0
    extra_keys = None
    if "extra_keys" in fields and (s.lora or s.salt):
        # the LoRA name on every block, the cache salt on the first one only
        extra_keys = [["sql-lora"] if s.lora else None for _ in range(n_blocks)]
        if s.salt and n_blocks:
            extra_keys[0] = [*(extra_keys[0] or []), s.salt]
    return StoreMeta(
        lora_id=1 if s.lora else None,
        lora_name="sql-lora" if s.lora and "lora_name" in fields else None,
        session_id=s.session,
        extra_keys=extra_keys,
        # the token after each block (none after the last one)
        lookahead_token_ids=[
            list(tokens[(i + 1) * block_size : (i + 1) * block_size + 1]) for i in range(n_blocks)
        ]
        if s.lookahead
        else None,
    )


def _fmt(
    name: str,
    release: str,
    version: tuple[int, int],
    stored: StoreFn,
    removed: RemoveFn,
    cleared: Any,
    *,
    medium: bool,
    hash_kind: str = "uint64",
    meta: str = "",
    topic_replay: bool = False,
    group_idx: int | None = None,
) -> WireFormat:
    routes = ("/health", "/metrics", *(("/kv_event_sources",) if version >= (31, 0) else ()))
    return WireFormat(
        name, "vllm", release, version, stored, removed, cleared, _meta,
        frozenset(meta.split()), medium, hash_kind, "CPU", routes,
        replay_with_topic=topic_replay,
        group_idx=group_idx,
    )  # fmt: skip


_V33_META = "lora_id lora_name extra_keys session_id lookahead_token_ids"
FORMATS = (
    _fmt("vllm-0.10", "0.10.0", (10, 0), stored6, removed2, ClearedArr(), medium=False, meta="lora_id"),
    _fmt(
        "vllm-0.23", "0.23.0", (23, 0), _s_v23, _r_v23, ClearedArr(),
        medium=True, meta="lora_id lora_name extra_keys", group_idx=0,
    ),
    _fmt(
        "vllm-0.33", "0.33.0", (33, 0), _s_v33, _r_v33, ClearedMap(),
        medium=True, meta=_V33_META, topic_replay=True, group_idx=0,
    ),
    _fmt(
        "vllm-0.33-bytes", "0.33.0", (33, 0), _s_v33, _r_v33, ClearedMap(),
        medium=True, hash_kind="bytes32", meta=_V33_META, topic_replay=True, group_idx=0,
    ),
)  # fmt: skip

_LABELS = ["model_name", "engine"]


def metrics(n: NodeMetrics) -> list[Metric]:
    """`vllm:*` scheduler metrics, one series per rank the API server manages."""
    old = n.fmt.version < (11, 0)  # 0.10 still used the gpu_* names
    usage = "vllm:gpu_cache_usage_perc" if old else "vllm:kv_cache_usage_perc"
    prefix = "vllm:gpu_prefix_cache_" if old else "vllm:prefix_cache_"
    running = GaugeMetricFamily(
        "vllm:num_requests_running", "Requests in model execution batches.", labels=_LABELS
    )
    waiting = GaugeMetricFamily(
        "vllm:num_requests_waiting", "Requests waiting to be processed.", labels=_LABELS
    )
    kv = GaugeMetricFamily(usage, "KV-cache usage. 1 means 100 percent usage.", labels=_LABELS)
    queries = CounterMetricFamily(
        f"{prefix}queries", "Prefix cache queries, in tokens.", labels=_LABELS
    )
    hits = CounterMetricFamily(f"{prefix}hits", "Prefix cache hits, in tokens.", labels=_LABELS)
    info_labels = ["block_size", "num_gpu_blocks", "enable_prefix_caching", "engine"]
    info = GaugeMetricFamily(
        "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=info_labels
    )
    for r in n.ranks:
        labels = [n.model_name, str(r.rank)]
        running.add_metric(labels, r.running)
        waiting.add_metric(labels, r.waiting)
        kv.add_metric(labels, r.held_tokens / n.capacity_tokens)  # blocks with ref_cnt > 0
        queries.add_metric(labels, r.query_tokens)
        hits.add_metric(labels, r.hit_tokens)
        blocks = str(n.capacity_tokens // n.page_size)
        info.add_metric([str(n.page_size), blocks, "True", str(r.rank)], 1.0)
    return [running, waiting, kv, queries, hits, info]


SIM = SimEngine(
    name="vllm",
    title="vLLM",
    formats=FORMATS,
    followers="hybrid",
    reports_managed_ranks=True,  # with internal LB node 0's server hears every engine core
    metrics=metrics,
)
