"""SGLang: what kvobserve reads from it, per version (facts from each released wheel: the KV-event
structs in `disaggregation/kv_events.py`, `/server_info` in `entrypoints/http_server.py`, the
port rule in `utils/common.py`, the metric names in `metrics/collector.py`)."""

from __future__ import annotations

from kvobserve.engines.profile import (
    Discovery,
    EngineProfile,
    RankLayout,
    SchedulerMetrics,
    WireVersion,
)

_STORED_ARRAY = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")
_STORED_MAP = (*_STORED_ARRAY, "medium", "cache_salt", "session_id", "lora_name")
_REMOVED = ("block_hashes", "medium")

PROFILE = EngineProfile(
    name="sglang",
    title="SGLang",
    pods=True,
    layout=RankLayout(
        dp_attention=True,
        pure_dp_on_leader=True,
        dp_rank_selection=(0, 5, 16),  # select_kv_publisher_dp_rank (sglang PR #29211)
    ),
    # /get_server_info: the name before 0.5 deprecated it (0.4.7 serves only that one)
    discovery=Discovery(routes=("/server_info", "/get_server_info")),
    metrics=SchedulerMetrics(
        names={
            "sglang:num_running_reqs": "running_requests",
            "sglang:num_queue_reqs": "queued_requests",
            "sglang:token_usage": "token_usage_ratio",
            "sglang:cache_hit_rate": "cache_hit_ratio",
            "sglang:max_total_num_tokens": "max_total_tokens",
        },
        rank_label="dp_rank",
        # the tokenizer's counters (summed over `cache_source` where it has one): every request
        # passes the API server's tokenizer, so they count the whole worker, with no rank
        worker_prefix_counters=("sglang:cached_tokens_total", "sglang:prompt_tokens_total"),
    ),
    default_endpoint="tcp://*:5557",  # --kv-events-config without an endpoint
    signed_hashes=True,  # hash_str_to_int64 (0.4.7: CPython's tuple hash)
    # the radix cache evicts unlocked leaves by last access (`--radix-eviction-policy lru`, the
    # default; an `lfu` policy is not recency-ordered and makes the curve wrong)
    eviction="radix leaves, least recently used first",
    recency_eviction=True,
    versions=(
        WireVersion(
            "0.4.7", "array", stored=_STORED_ARRAY, removed=("block_hashes",), replay="3 frames",
            hashes=("int64",), captures=("engine-captures/sglang-0.4.7",),
            note="a root's parent is hash(()), not null",
        ),
        WireVersion(
            "0.5.12", "array", stored=(*_STORED_ARRAY, "medium"), removed=_REMOVED,
            replay="3 frames", hashes=("int64",), captures=("engine-captures/sglang-0.5.12",),
        ),
        WireVersion(
            "0.5.19", "array", stored=(*_STORED_ARRAY, "medium", "{cache_salt}"),
            removed=_REMOVED, replay="3 frames", hashes=("int64",),
            captures=("engine-captures/sglang-0.5.19",),
            note="a store's element 7 is a {cache_salt} map, only when a salt is set; one "
            "removal per radix node",
        ),
        WireVersion(
            "0.5.22", "map", stored=_STORED_MAP, removed=_REMOVED, replay="4 frames, with topic",
            hashes=("int64",),
            note="the wire of 0.5.23; /server_info reports attention DP as attn_dp_size",
        ),
        WireVersion(
            "0.5.23", "map", stored=_STORED_MAP, removed=_REMOVED, replay="4 frames, with topic",
            hashes=("int64",), captures=("engine-captures/sglang-0.5.23",),
        ),
    ),
)  # fmt: skip
