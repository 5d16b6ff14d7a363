"""The metric catalog: one table (name, type, labels, help) used by /metrics, OTLP and docs/metrics.md."""

from __future__ import annotations

from dataclasses import dataclass

STREAM = ("worker_id", "node_rank", "dp_rank")
BLOCK = (*STREAM, "medium")
WORKER_MEDIUM = ("worker_id", "medium")
DRIFT = (*STREAM, "medium", "method")
BOUND = ("collector", "worker_id", "dp_rank")  # an endpoint a collector binds (bind mode)
CACHE_DETAIL = "per_stream_counters"  # the create_app flag ([aggregator] per_stream_detail)
# The "while down" cells of families whose rule `stale` alone does not tell (docs/metrics.md)
UP_RANKS = "up ranks only"
SCHEDULER = "absent, also when stale"

# The reference stream of the series budget (docs/metrics.md): two storage tiers, one replay
# result and one decode-error reason seen, a worker of 16 ranks, 8 streams per collector.
REFERENCE = {"medium": 2, "value": 1, "fault": 0, "worker": 16, "collector": 8, "buckets": 15}
BUDGET = 32  # series per stream by default (the series budget, docs/metrics.md)


@dataclass(frozen=True)
class MetricDef:
    """One exported family: its exposed name (counters end in _total), type, labels and help."""

    name: str
    type: str  # counter, gauge, histogram
    labels: tuple[str, ...]
    help: str
    # The staleness rule (docs/metrics.md): True: served while the stream is down or its
    # collector gone (counters, health); False: served only while it is up; None: not per stream
    stale: bool | None = None
    timely: bool = False  # value depends on the wall clock (masked in the golden scrape)
    per: str = "fleet"  # what one series stands for: see PER (the series budget)
    n: int = 1  # series per `per`
    detail: str = ""  # the FleetCollector flag that serves it per stream instead (labels STREAM+)
    optin: str = ""  # the FleetCollector flag without which it is not served at all
    down: str = ""  # the docs' "while down" cell when `stale` alone does not say it

    @property
    def while_down(self) -> str:
        """What /metrics serves of this family while its source is down (docs/metrics.md)."""
        if self.down:
            return self.down
        return "-" if self.stale is None else "kept" if self.stale else "absent"

    @property
    def detail_labels(self) -> tuple[str, ...]:
        """Labels with the per-stream opt-in: the stream's, plus the one a worker's series keep."""
        return (*STREAM, self.labels[-1]) if self.detail else self.labels

    def per_stream(self, detail: bool = False) -> float:
        """Series per stream in the reference fleet (REFERENCE), by default or with its opt-in."""
        r = REFERENCE
        if self.optin and not detail:
            return 0.0
        if self.per == "histogram":
            n = (r["buckets"] + 3) * r["medium"]
            return float(n) if detail else n / r["worker"]
        if self.per in ("worker_medium", "worker_type"):
            n = self.n * (r["medium"] if self.per == "worker_medium" else 1)
            return float(n) if detail else n / r["worker"]
        scale = {"stream": 1, "medium": r["medium"], "value": r["value"], "fault": 0, "drift": 0}
        if self.per in scale:
            return float(self.n * scale[self.per])
        if self.per in ("worker", "collector"):
            return self.n / r[self.per]
        return 0.0

    @property
    def family(self) -> str:
        """The prometheus_client family name (counters without the _total suffix)."""
        if self.type == "counter" and self.name.endswith("_total"):
            return self.name[: -len("_total")]
        return self.name


PER = {
    "stream": "per stream",
    "medium": "per stream and storage tier",
    "value": "per stream and label value seen",
    "fault": "per stream while the fault lasts",
    "drift": "per stream and tier a router indexes, with a drift source only (docs/dynamo.md)",
    "worker": "per worker, shared by its ranks",
    "worker_medium": "per worker and storage tier, shared by its ranks",
    "worker_type": "per worker and event type, shared by its ranks",
    "histogram": "(buckets + 3) per worker and storage tier, shared by its ranks",
    "collector": "per collector, shared by its streams",
    "bind": "per endpoint a collector binds (bind mode: one per rank of the worker)",
    "fleet": "not per stream",
}


def _d(
    name: str,
    typ: str,
    labels: tuple[str, ...],
    text: str,
    *,
    stale: bool | None = None,
    timely: bool = False,
    per: str | None = None,
    n: int = 1,
    detail: str = "",
    optin: str = "",
    down: str = "",
) -> MetricDef:
    if stale is None and (labels[:3] == STREAM or detail):
        # Counters and histograms are cumulative, so a stale value is still true: serve them.
        stale = typ != "gauge"
    if per is None:
        per = "stream" if labels[:3] == STREAM else "fleet"
    return MetricDef(name, typ, labels, text, stale, timely, per, n, detail, optin, down)


CATALOG: tuple[MetricDef, ...] = (
    # per stream: identity and health
    _d("kvobserve_stream_info", "gauge", (*STREAM, "engine", "endpoint", "topic", "collector"),
       "Always 1; identifies the stream's engine, endpoint, topic and collector.", stale=True),
    _d("kvobserve_stream_up", "gauge", STREAM,
       "1 while the stream is connected, healthy and its collector reports; 0 otherwise.", stale=True),
    _d("kvobserve_kv_event_batches_total", "counter", STREAM, "KV-event batches applied."),
    _d("kvobserve_kv_events_total", "counter", ("worker_id", "type"),
       "KV events by type, summed over the worker's ranks: stored, removed, cleared (applied); "
       "other_group (vLLM side KV-cache groups, set aside).",
       per="worker_type", n=3, detail="per_stream_counters"),
    # per stream and medium: the block index
    _d("kvobserve_kv_blocks", "gauge", BLOCK, "Resident blocks in the stream's block index.",
       per="medium"),
    _d("kvobserve_kv_tokens", "gauge", BLOCK,
       "Resident tokens: each resident block counts the tokens its BlockStored event gave it "
       "(the event's block_size; SGLang's last page of a request holds fewer than the page "
       "size; Dynamo events carry none: the worker's block_size), so at most blocks x block "
       "size.", per="medium"),
    _d("kvobserve_kv_blocks_stored_total", "counter", WORKER_MEDIUM,
       "Blocks stored (BlockStored hashes); summed over the worker's ranks.",
       per="worker_medium", detail="per_stream_counters"),
    _d("kvobserve_kv_blocks_removed_total", "counter", WORKER_MEDIUM,
       "Blocks removed (BlockRemoved hashes); summed over the worker's ranks.",
       per="worker_medium", detail="per_stream_counters"),
    _d("kvobserve_kv_blocks_unchanged_total", "counter", ("worker_id", "kind"),
       "Block hashes in events that changed nothing, summed over the worker's ranks: "
       "already_resident (stored while resident; the first store time is kept), not_resident "
       "(removed while not resident).",
       per="worker_type", n=2, detail="per_stream_counters"),
    _d("kvobserve_kv_capacity_tokens", "gauge", STREAM,
       "KV capacity in tokens, from the worker config or the rank's scheduler metrics."),
    _d("kvobserve_kv_cache_usage_ratio", "gauge", STREAM,
       "Cache usage: GPU-tier resident tokens / capacity (about 1 on any warm prefix cache); "
       "absent while the capacity is unknown. Not token usage."),
    _d("kvobserve_kv_block_lifetime_seconds", "histogram", WORKER_MEDIUM,
       "Block lifetime: removal time - store time (engine timestamps), over the worker's ranks.",
       per="histogram", detail="per_stream_histograms"),
    # per stream: sequence accounting
    _d("kvobserve_kv_sequence_gaps_total", "counter", STREAM, "Sequence gaps seen (occurrences)."),
    _d("kvobserve_kv_batches_missed_total", "counter", STREAM, "Batches missing in sequence gaps."),
    _d("kvobserve_kv_batches_recovered_total", "counter", STREAM, "Missed batches recovered by replay."),
    _d("kvobserve_kv_batches_lost_total", "counter", STREAM, "Missed batches not recovered."),
    _d("kvobserve_kv_replay_requests_total", "counter", (*STREAM, "result"),
       "Replay requests sent, by result.", per="value"),
    _d("kvobserve_kv_publisher_restarts_total", "counter", STREAM,
       "Publisher restarts (sequence fell back); the block index was reset."),
    _d("kvobserve_kv_duplicate_batches_total", "counter", STREAM,
       "Batches redelivered with a seen sequence number and payload; ignored."),
    _d("kvobserve_kv_duplicate_stream", "gauge", STREAM,
       "1 while interleaved or mirrored publishers are seen on the stream."),
    _d("kvobserve_kv_rank_mismatch_batches_total", "counter", STREAM,
       "Batches whose dp rank differs from the rank the port belongs to."),
    _d("kvobserve_kv_interleaved_batches_total", "counter", STREAM,
       "Batches of a second publisher interleaved on the stream, dropped (served once seen).",
       per="fault"),
    _d("kvobserve_kv_unexpected_stream", "gauge", (*STREAM, "endpoint"),
       "1 while a probed port past the worker's last rank carries events (dp_rank of that port).",
       per="fault"),
    _d("kvobserve_kv_decode_errors_total", "counter", (*STREAM, "reason"),
       "Messages that failed to decode, by reason; skipped.", per="value"),
    _d("kvobserve_kv_state_complete", "gauge", STREAM,
       "1 when the block index is known complete; 0 = usage is a lower bound."),
    _d("kvobserve_kv_last_batch_timestamp_seconds", "gauge", STREAM,
       "Engine timestamp of the last applied batch (Unix seconds).", timely=True, stale=True),
    _d("kvobserve_kv_event_lag_seconds", "gauge", STREAM,
       "Receive time - engine timestamp of the last batch.", timely=True),
    # cache analytics (docs/cache-analytics.md): trust, silent loss, thrash, placement
    _d("kvobserve_kv_view_trust_ranks", "gauge", ("worker_id", "trust"),
       "Ranks of the worker that are up whose block-index view is in each trust state: "
       "complete, replay_filled, partial (a state no rank is in is not served).", per="worker",
       down=UP_RANKS),
    _d("kvobserve_kv_silent_loss_evidence_total", "counter", (*STREAM, "reason"),
       "Evidence of KV events lost without a sequence gap, by reason: remove_unknown (blocks "
       "removed that were not resident), parent_unknown (stores whose parent is not resident); "
       "served once nonzero.", per="fault"),
    _d("kvobserve_kv_resident_over_capacity", "gauge", STREAM,
       "1 while the GPU tier's resident tokens exceed the rank's capacity (removals were lost); "
       "served only then.", per="fault"),
    _d("kvobserve_kv_blocks_restored_total", "counter", WORKER_MEDIUM,
       "Blocks stored again on the same rank and tier within the restore window (300 s) after "
       "their removal (eviction thrash); summed over the worker's ranks.", per="worker_medium"),
    _d("kvobserve_kv_restore_untracked_total", "counter", ("worker_id",),
       "Removals the restore window could not track (its cap), summed over the worker's ranks: "
       "restores are a lower bound once it grows; served once nonzero.", per="fault"),
    _d("kvobserve_worker_kv_redundancy_ratio", "gauge", ("worker_id",),
       "Top-tier resident blocks summed over the worker's ranks / distinct blocks among them "
       "(1 = no block on two ranks).", per="worker"),
    _d("kvobserve_worker_kv_recomputed_elsewhere_total", "counter", ("worker_id",),
       "Blocks stored on a rank while another rank of the worker (in the same collector) held "
       "them.", per="worker"),
    _d("kvobserve_kv_block_restore_gap_seconds", "histogram", ("worker_id",),
       "Removal-to-restore time of restored blocks, over the worker's ranks and tiers.",
       per="worker", n=17, optin=CACHE_DETAIL),
    _d("kvobserve_kv_tier_moves_total", "counter", ("worker_id", "from", "to"),
       "Blocks stored on tier `to` that tier `from` of the same rank held or had just removed "
       "(GPU to CPU: offload; CPU to GPU: onboard), summed over the worker's ranks.",
       per="worker", n=2, optin=CACHE_DETAIL),
    _d("kvobserve_kv_tier_unread_blocks", "gauge", WORKER_MEDIUM,
       "Lower-tier resident blocks not read back to the top tier so far, summed over the "
       "worker's ranks.", per="worker", optin=CACHE_DETAIL, down=UP_RANKS),
    _d("kvobserve_kv_tier_unread_removed_total", "counter", WORKER_MEDIUM,
       "Lower-tier blocks removed without having been read back, summed over the worker's "
       "ranks.", per="worker", optin=CACHE_DETAIL),
    _d("kvobserve_kv_lora_blocks", "gauge", ("worker_id", "medium", "lora_name"),
       "Resident blocks per LoRA adapter (names capped per stream; later ones as _other), "
       "summed over the worker's ranks.", per="worker", optin=CACHE_DETAIL, down=UP_RANKS),
    _d("kvobserve_worker_kv_blocks_distinct", "gauge", ("worker_id",),
       "Distinct top-tier resident blocks over the worker's ranks (a sketch estimate across "
       "collectors).", per="worker", optin=CACHE_DETAIL),
    _d("kvobserve_worker_kv_blocks_replicated", "gauge", ("worker_id", "ranks"),
       "Distinct top-tier blocks resident on exactly `ranks` ranks of the worker (2, 3, ...; "
       "8 or more as 8+).", per="worker", optin=CACHE_DETAIL),
    _d("kvobserve_worker_kv_placement_relative_error", "gauge", ("worker_id",),
       "One standard error of the distinct-block estimate, relative (0 when exact).",
       per="worker", optin=CACHE_DETAIL),
    # router-index drift (docs/dynamo.md): the last comparison of a router's index with ours
    _d("kvobserve_router_index_phantom_blocks", "gauge", DRIFT,
       "Blocks the router's index holds that the engine evicted (settled blocks only).",
       per="drift"),
    _d("kvobserve_router_index_missing_blocks", "gauge", DRIFT,
       "Blocks the engine holds that the router's index lacks (settled blocks only).",
       per="drift"),
    _d("kvobserve_router_index_jaccard", "gauge", DRIFT,
       "Jaccard similarity of the router's and the engine's block sets (method dump only).",
       per="drift"),
    _d("kvobserve_router_index_router_blocks", "gauge", DRIFT,
       "Blocks the router's index holds for the stream and tier.", per="drift"),
    _d("kvobserve_router_index_engine_blocks", "gauge", DRIFT,
       "Blocks kvobserve's event-derived index holds for the stream and tier.", per="drift"),
    _d("kvobserve_collector_router_index_comparisons_total", "counter",
       ("collector", "worker_id", "result"),
       "Comparisons with a router or indexer, by result (ok, http, connection, decode, busy).",
       per="drift"),
    _d("kvobserve_collector_router_index_last_success_timestamp_seconds", "gauge",
       ("collector", "worker_id"),
       "Time of the last successful comparison with the router (Unix seconds).", timely=True,
       per="drift"),
    # fleet: ownership and workers
    _d("kvobserve_dp_rank_owners", "gauge", ("worker_id", "dp_rank"),
       "Live collectors owning the rank (0 = uncovered, >1 = duplicated).", per="stream"),
    _d("kvobserve_dp_rank_last_owner_info", "gauge",
       ("worker_id", "dp_rank", "collector", "node_rank"),
       "Always 1, while no live collector owns the rank: the down collector that owned it "
       "last (DPRankUncovered carries its labels for the inhibition, docs/alerts.md).",
       per="fault"),
    _d("kvobserve_worker_dp_size", "gauge", ("worker_id",), "Declared data-parallel size.",
       per="worker"),
    _d("kvobserve_worker_leaders", "gauge", ("worker_id",),
       "Live collectors reading the worker's scheduler metrics (should be 1).", per="worker"),
    _d("kvobserve_worker_state", "gauge", ("worker_id", "node_rank", "collector", "state"),
       "1 while a live collector cannot watch a configured worker, by state: undiscovered (no "
       "KV-event stream known: discovery failed or answered nothing usable), layout_mismatch "
       "(the engine's own layout contradicts the config); served only then, the reason is in "
       "/api/v1/fleet.", stale=False, per="fault"),
    _d("kvobserve_scheduler_source_state", "gauge",
       ("worker_id", "node_rank", "collector", "source", "state"),
       "1 while a scheduler source of a live collector delivers nothing, by state: down (it "
       "failed, or a heartbeat source sent nothing for 10 intervals), undecodable; served only "
       "then, the reason is in /api/v1/fleet.", stale=False, per="fault"),
    # collectors
    _d("kvobserve_collector_up", "gauge", ("collector", "node_rank", "hostname"),
       "1 while the collector's snapshots arrive; 0 after 3 silent intervals.", per="collector"),
    _d("kvobserve_collector_snapshot_age_seconds", "gauge", ("collector",),
       "Seconds since the collector's last snapshot arrived.", timely=True, per="collector"),
    _d("kvobserve_collector_start_time_seconds", "gauge", ("collector",),
       "Start time of the collector process (Unix seconds).", timely=True, per="collector"),
    _d("kvobserve_collector_refused_total", "counter", ("collector", "what"),
       "What a cardinality cap refused: streams (max_streams), medium_events (events of a "
       "storage tier past the per-stream cap), passthrough_samples.", per="fault"),
    _d("kvobserve_collector_messages_received_total", "counter", ("collector",),
       "KV-event messages the collector read from its streams and probe ports.", per="collector"),
    _d("kvobserve_collector_ingest_errors_total", "counter", ("collector",),
       "Turns of the collector's ingest loop that failed (logged; the loop goes on).",
       per="collector"),
    _d("kvobserve_collector_publish_dropped_total", "counter", ("collector", "reason"),
       "Snapshots the collector could not publish, by reason (closed, buffer_full, too_large, "
       "error); reported with its next snapshot that arrives.", per="fault"),
    # bind mode (docs/deployment.md): the endpoints a collector binds, per rank, and their relays
    _d("kvobserve_bind_publishers", "gauge", (*BOUND, "endpoint"),
       "Connections open on an endpoint the collector binds for publishers to connect to.",
       per="bind"),
    _d("kvobserve_bind_messages_total", "counter", BOUND,
       "Messages received on the bound endpoint.", per="bind"),
    _d("kvobserve_bind_skipped_total", "counter", (*BOUND, "reason"),
       "Messages of the bound endpoint that no stream took, by reason: topic_mismatch (the "
       "topic does not fit the worker's topic), refused (a new publisher past max_streams), "
       "analysis_behind (relayed, but the analysis was behind: its stream sees a gap); served "
       "once nonzero.", per="bind"),
    _d("kvobserve_relay_up", "gauge", (*BOUND, "target"),
       "1 while the relay target of the bound endpoint is connected and subscribed.", per="bind"),
    _d("kvobserve_relay_forwarded_total", "counter", BOUND,
       "Frames forwarded unchanged to the relay target.", per="bind"),
    _d("kvobserve_relay_dropped_total", "counter", (*BOUND, "reason"),
       "Frames not forwarded to the relay target, by reason: no_target (none connected and "
       "subscribed), queue_full (relay_queue frames already waiting for it).", per="bind"),
    # scheduler metrics per rank, joined across collectors, under the node that owns the rank
    _d("kvobserve_scheduler_running_requests", "gauge", STREAM, "Running requests of the rank.",
       down=SCHEDULER),
    _d("kvobserve_scheduler_queued_requests", "gauge", STREAM, "Queued requests of the rank.",
       down=SCHEDULER),
    _d("kvobserve_scheduler_token_usage_ratio", "gauge", STREAM,
       "Token usage: KV held by the rank's running requests / capacity, as its scheduler "
       "reports it (0-1). Not cache usage.", down=SCHEDULER),
    _d("kvobserve_scheduler_cache_hit_ratio", "gauge", STREAM, "Prefix cache hit ratio (0-1).",
       down=SCHEDULER),
    _d("kvobserve_scheduler_max_total_tokens", "gauge", STREAM,
       "KV capacity in tokens as the scheduler reports it.", down=SCHEDULER),
    _d("kvobserve_scheduler_source_errors_total", "counter",
       ("worker_id", "node_rank", "source", "reason"),
       "Scheduler-source messages a collector could not use (e.g. reason pickle_refused), by "
       "node, source (metrics, load, kv_metrics, fpm) and reason.", per="fault"),
    # the aggregator itself
    _d("kvobserve_aggregator_snapshots_applied_total", "counter", (),
       "Collector snapshots applied to the fleet state."),
    _d("kvobserve_aggregator_snapshots_ignored_total", "counter", (),
       "Collector snapshots ignored as older than the one held (reordered or replayed)."),
    _d("kvobserve_aggregator_snapshot_decode_errors_total", "counter", ("reason",),
       "Snapshot messages that failed to decode, by reason."),
    _d("kvobserve_nats_connected", "gauge", (),
       "1 while the aggregator's NATS connection is up (absent in embedded mode)."),
    _d("kvobserve_nats_snapshots_received_total", "counter", (),
       "Collector snapshots received over NATS (live and from the JetStream KV bucket)."),
    _d("kvobserve_nats_reconnects_total", "counter", (), "NATS reconnections."),
    _d("kvobserve_nats_dropped_total", "counter", ("reason",),
       "Messages the aggregator could not send or handle over NATS, by reason."),
    _d("kvobserve_build_info", "gauge", ("version",), "Always 1; the kvobserve version."),
)  # fmt: skip

BY_NAME: dict[str, MetricDef] = {m.name: m for m in CATALOG}
# What every shard of sharded aggregators serves for itself or for each collector it hears:
# labelled `shard` there (docs/scale.md), so the shards' scrapes never repeat a series.
SHARD_LABELLED = frozenset(
    m.name
    for m in CATALOG
    if m.name.startswith(("kvobserve_collector_", "kvobserve_aggregator_", "kvobserve_nats_"))
    or m.name == "kvobserve_build_info"
)
BY_FAMILY: dict[str, MetricDef] = {m.family: m for m in CATALOG}

_HEADER = """\
# kvobserve metrics

<!-- Generated by `python -m kvobserve.export.prometheus --docs > docs/metrics.md` from
kvobserve/export/catalog.py; do not edit by hand (tests/unit/test_export_docs.py checks it). -->

Every series the aggregator serves on `/metrics` (and the collector on its local `/metrics`).
Stream series carry `worker_id`, `node_rank` (of the collector that watches the stream) and
`dp_rank`; block series add `medium` (storage tier: `GPU`, `CPU`, ...).

**The staleness rule.** A gauge is served only while its source is live, as Prometheus itself
treats the series of a dead target: a value nobody measures any more is absent, never its last
value, so no dashboard shows a dead rank as busy and no alert fires on it. Column *while down*:
- `kept`: served while the stream is down (not in an up state, docs/collector.md "Stream
  states") or its collector is gone: every counter and histogram (nothing collected is lost and
  `rate()` does not reset) and the health series that say it is down (`kvobserve_stream_info`,
  `kvobserve_stream_up` 0, the last batch's time).
- `absent`: a gauge of the stream's cache (blocks, tokens, capacity, cache usage, trust, lag,
  duplicate-stream, index complete, over capacity, router-index drift), served only while the
  stream is up and its collector reports. `/api/v1/streams`, the status page and `kvobserve
  status` show them as unknown (`null`, `-`).
- `absent, also when stale`: a rank's scheduler gauges, absent while its stream is down or its
  collector gone, and also once the rank's values are older than `stale_intervals` (3) times the
  longer of its collector's interval and its source's own period (the load and FPM PUBs' 1 s
  heartbeat, the `/metrics` scrape's 2 s timeout, Dynamo's 10 s `kv_metrics` heartbeat), by the
  collector's clock. The capacity a scheduler reported is kept for cache usage (a constant of
  the engine process).
- `up ranks only`: a per-worker gauge summed over the worker's ranks that are up.
- `-`: fleet-level, always served; rank owners and scheduler leaders count live collectors only.

A collector is down after 3 of its intervals without a snapshot (`kvobserve_collector_up` 0;
`[aggregator] stale_intervals`) and forgotten altogether after an hour.

**Two usages.** *Cache usage* (`kvobserve_kv_cache_usage_ratio`; `USAGE` in `kvobserve status`,
"cache usage" on the status page) is the GPU-tier tokens resident in the stream's block index
over the capacity: a prefix cache evicts only when it must, so it is about 100% on any warm
cache, and that is healthy. *Token usage* (`kvobserve_scheduler_token_usage_ratio`;
`TOKEN_USAGE`, "token usage") is what the engine's scheduler reports: KV held by running
requests, evictable cached blocks left out. `KVCacheNearFull` watches token usage.

**Endpoints.** `/metrics` (text format 0.0.4, or OpenMetrics when the `Accept` header asks for
`application/openmetrics-text`), `/healthz`, `/readyz` (503 until the first snapshot),
`/api/v1/streams`, `/api/v1/alerts`, `/api/v1/fleet`, `/api/v1/hot` (JSON; docs/cache-analytics.md)
and the status page `/`.

**Shards.** With `[aggregator] shards` > 1 (docs/scale.md) each aggregator serves the workers of
its shard; the series of the collectors it hears (`kvobserve_collector_*`) and its own
(`kvobserve_aggregator_*`, `kvobserve_nats_*`, `kvobserve_build_info`) then carry a `shard`
label (the aggregator's index), so that no two shards serve the same series.

**Passthrough.** Engine metric families a collector forwards (for example the leader's scheduler
metrics) are served with their own type, labels and values, from live collectors only; `:` in
a name becomes `_` (colons are reserved for recording rules), so `sglang:num_running_reqs` is
served as `sglang_num_running_reqs`. Names starting with `kvobserve_` are never passed through.

**OTLP.** With `--otlp-endpoint URL` the same series (names, `_total` included, and labels as
attributes) are pushed over OTLP/HTTP: counters as cumulative sums, gauges as gauges. The
histogram and passthrough families are left out of OTLP.

**Golden scrape.** `tests/fixtures/golden/metrics.txt` is a deterministic scrape of a fixed fleet;
regenerate it with `KVOBSERVE_UPDATE_GOLDEN=1 .venv/bin/pytest tests/unit/test_export_golden.py`.

| name | type | labels | while down | meaning |
|---|---|---|---|---|
"""


_BUDGET = """
## Series budget

At most {budget} series per stream by default. Block counters, event counters and
block-lifetime histograms are the bulk of a stream's series and are rarely read per rank, so they
are summed over the worker's ranks by default (labels `worker_id` plus `medium`, `type` or `kind`;
stale streams' values included, a clash counted once). `[aggregator] per_stream_detail = true`
(`--per-stream-detail`) serves them per stream instead, with the stream's labels (in the table:
"with `per_stream_counters`" / "`per_stream_histograms`", the two keyword arguments of
`create_app` that the setting turns on; it also serves the cache-analytics detail families marked
"only with `per_stream_counters`": restore gaps, tier moves, LoRA blocks, placement). A per-worker sum drops when
one of its streams' collectors restarts; `rate()` reads that as a counter reset, as for any
restarted exporter.

Series per stream of each family in the reference fleet: every stream with {medium} storage tiers
(e.g. `GPU`, `CPU_PINNED`), one replay result and one decode-error reason seen, the worker's
{worker} ranks spread over collectors of {collector} streams, {buckets} lifetime buckets, the cache
analytics on (one LoRA adapter, blocks on 2 ranks, moves both ways between the two tiers), no
router-index drift source (with one: 5 series per stream and indexed tier, docs/dynamo.md).
`tests/unit/test_series_budget.py` renders such a fleet and checks this table against it.

| name | one series | per stream | per stream with the opt-in |
|---|---|---|---|
"""


def _num(x: float) -> str:
    return f"{x:.3f}".rstrip("0").rstrip(".")


def reference_total(detail: bool = False) -> float:
    """Series per stream of the reference fleet, summed over the catalog."""
    return sum(m.per_stream(detail) for m in CATALOG)


def render_docs() -> str:
    """docs/metrics.md, generated from CATALOG."""
    rows = []
    for m in CATALOG:
        labels = ", ".join(f"`{lb}`" for lb in m.labels) or "-"
        if m.detail:
            labels += (
                f" (with `{m.detail}`: " + ", ".join(f"`{lb}`" for lb in m.detail_labels) + ")"
            )
        if m.optin:
            labels += f" (only with `{m.optin}`)"
        rows.append(f"| `{m.name}` | {m.type} | {labels} | {m.while_down} | {m.help} |\n")
    budget = [_BUDGET.format(budget=BUDGET, **REFERENCE)]
    for m in CATALOG:
        if m.per == "fleet":
            continue
        opt = _num(m.per_stream(True)) if m.detail or m.optin else ""
        budget.append(f"| `{m.name}` | {PER[m.per]} | {_num(m.per_stream())} | {opt} |\n")
    total, detailed = reference_total(), reference_total(True)
    budget.append(f"| **total** | | **{_num(total)}** | {_num(detailed)} (both options) |\n")
    return _HEADER + "".join(rows) + "".join(budget)
