"""vLLM: what kvobserve reads from it, per version (facts from each released wheel: the KV-event
structs in `vllm/distributed/kv_events.py`, `/kv_event_sources` in the API server (0.31+), the
metric names in `vllm/v1/metrics/loggers.py`)."""

from __future__ import annotations

from kvobserve.engines.profile import (
    Discovery,
    EngineProfile,
    RankLayout,
    SchedulerMetrics,
    WireVersion,
)

_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")
_STORED_23 = (
    *_STORED, "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)  # fmt: skip

PROFILE = EngineProfile(
    name="vllm",
    title="vLLM",
    pods=True,
    full_blocks_only=True,  # KVCacheManager stores a block once it is full (block_size tokens)
    layout=RankLayout(keeps_port_zero=True),  # every DP rank publishes as itself, wherever it runs
    discovery=Discovery(
        routes=("/kv_event_sources",),
        missing="vLLM before 0.31 has no /kv_event_sources; give kv_endpoint, replay_endpoint "
        "and dp_size in the [[worker]] table by hand",
        several_urls=True,  # hybrid DP load balancing: an API server per node, its own ranks
        block_sizes=True,
    ),
    metrics=SchedulerMetrics(
        names={
            "vllm:num_requests_running": "running_requests",
            "vllm:num_requests_waiting": "queued_requests",
            "vllm:kv_cache_usage_perc": "token_usage_ratio",
            "vllm:gpu_cache_usage_perc": "token_usage_ratio",  # the name before 0.11
        },
        rank_label="engine",  # vLLM labels its DP engines `engine`
        prefix_counters=("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
        cache_info="vllm:cache_config_info",
    ),
    default_endpoint="tcp://*:5557",
    # the free block queue: a finished request's blocks go to its tail in reverse order, and a
    # new block is taken from its head (the least recently used cached block)
    eviction="free block queue, least recently used first",
    recency_eviction=True,
    versions=(
        WireVersion(
            "0.10.0", "array", stored=_STORED, removed=("block_hashes",), replay="3 frames",
            hashes=("uint64",), captures=("engine-captures/vllm-0.10.0",),
        ),
        WireVersion(
            "0.23.0", "array", stored=_STORED_23, removed=("block_hashes", "medium", "group_idx"),
            replay="3 frames", hashes=("uint64",), captures=("engine-captures/vllm-0.23.0",),
        ),
        WireVersion(
            "0.33.0", "map",
            stored=(*_STORED_23, "locality", "ownership", "session_id", "lookahead_token_ids"),
            removed=("block_hashes", "medium", "group_idx", "locality", "ownership"),
            replay="4 frames, with topic", hashes=("uint64", "bytes32"),
            captures=("engine-captures/vllm-0.33.0", "engine-captures/vllm-0.33.0-bytes-hashes"),
            note="32-byte hashes with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0",
        ),
    ),
)  # fmt: skip
