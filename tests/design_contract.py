"""The names the project fixes (alerts, metrics): one copy of the contract for every test.

Alert names are documented in docs/alerts.md, metric names in docs/metrics.md; renaming one is a
breaking change for every dashboard and rule that uses it.
"""

from __future__ import annotations

# The alert names (docs/alerts.md): the contract.
DESIGN_ALERTS = tuple(
    """
KVEventSequenceGap KVEventsLost KVEventDuplicateStream KVEventRankMismatch
KVEventUnexpectedStream KVEventPublisherRestarted KVEventStreamDown KVEventStreamStalled
KVEventDecodeErrors KVCacheNearFull KVIndexIncomplete DPRankUncovered DPRankMultipleOwners
MultipleSchedulerLeaders KVObserveCollectorDown KVEventSilentLoss KVCacheThrash KVRouterIndexDrift
KVWorkerUndiscovered KVWorkerLayoutMismatch KVSchedulerSourceDown
KVRelayDropping
""".split()  # noqa: SIM905 (a compact copy of the contract)
)

# The metric names (docs/metrics.md); histograms add _bucket/_sum/_count.
DESIGN_METRICS = frozenset(
    """
kvobserve_stream_info kvobserve_stream_up kvobserve_kv_event_batches_total
kvobserve_kv_events_total kvobserve_kv_blocks kvobserve_kv_tokens
kvobserve_kv_blocks_stored_total kvobserve_kv_blocks_removed_total kvobserve_kv_capacity_tokens
kvobserve_kv_cache_usage_ratio kvobserve_kv_block_lifetime_seconds
kvobserve_kv_sequence_gaps_total kvobserve_kv_batches_missed_total
kvobserve_kv_batches_recovered_total kvobserve_kv_batches_lost_total
kvobserve_kv_replay_requests_total kvobserve_kv_publisher_restarts_total
kvobserve_kv_duplicate_batches_total kvobserve_kv_duplicate_stream
kvobserve_kv_rank_mismatch_batches_total kvobserve_kv_unexpected_stream
kvobserve_kv_decode_errors_total kvobserve_kv_state_complete
kvobserve_kv_last_batch_timestamp_seconds kvobserve_kv_event_lag_seconds
kvobserve_dp_rank_owners kvobserve_worker_dp_size kvobserve_worker_leaders
kvobserve_collector_up kvobserve_scheduler_running_requests kvobserve_scheduler_queued_requests
kvobserve_scheduler_token_usage_ratio kvobserve_scheduler_cache_hit_ratio
kvobserve_scheduler_max_total_tokens kvobserve_build_info
""".split()  # noqa: SIM905 (a compact copy of the catalog)
)
