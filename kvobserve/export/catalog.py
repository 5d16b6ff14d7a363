"""The metric catalog: one row per family (name, type, labels, help, where its values come from).

/metrics (both the prometheus_client collector and the cached text), OTLP and docs/metrics.md are
all read off this table; export/series.py reads each row's values off a FleetView.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvobserve import __version__
from kvobserve.analysis.conditions import SOURCE_DOWN, WORKER_TROUBLE
from kvobserve.analysis.views import KINDS as MISS_KINDS
from kvobserve.analysis.views import CollectorView, FleetView
from kvobserve.wire.snapshot import RELAY_DROP_REASONS

STREAM = ("worker_id", "node_rank", "dp_rank")
BLOCK = (*STREAM, "medium")
WORKER_MEDIUM = ("worker_id", "medium")
DRIFT = (*STREAM, "medium", "method")
BOUND = ("collector", "worker_id", "dp_rank")  # an endpoint a collector binds (bind mode)
CACHE_DETAIL = "per_stream_counters"  # the create_app flag ([aggregator] per_stream_detail)
# The "while down" cells of families whose rule `stale` alone does not tell (docs/metrics.md)
UP_RANKS = "up ranks only"
SCHEDULER = "absent, also when stale"
EVENT_TYPES = ("stored", "removed", "cleared")  # always served, in this order, before the others
REPLICATED_CAP = 8  # blocks on this many ranks or more share one `ranks` label value ("8+")


class Scope(enum.Enum):
    """What one sample of a family stands for: an item of a collector's part of the view.

    Each item gives its labels by name: a stream's `worker_id`, `node_rank` (of the collector
    that watches it) and `dp_rank`, a storage tier's `medium` too, and so on (export/series.py).
    """

    STREAM = "stream"  # analysis.fleet.StreamView (`stats`: wire.snapshot.StreamStats)
    MEDIUM = "medium"  # wire.snapshot.MediumStats of a stream (up while its stream is)
    SCHEDULER = "scheduler"  # wire.snapshot.SchedulerStats, joined per rank (fresh ones only)
    UNEXPECTED = "unexpected"  # wire.snapshot.UnexpectedStream
    DRIFT = "drift"  # wire.snapshot.DriftStats, while its collector and stream are up
    DRIFT_SOURCE = "drift_source"  # wire.snapshot.DriftSource, while its collector is up
    COLLECTOR = "collector"  # analysis.fleet.CollectorView
    SOURCE_ERROR = "source_error"  # wire.snapshot.SourceErrors
    WORKER = "worker"  # wire.snapshot.WorkerInfo (up while its collector is)
    SOURCE = "source"  # wire.snapshot.SourceState, a scheduler source (up while its collector is)
    BIND = "bind"  # wire.snapshot.BindStats, an endpoint bound (up while its collector is)


class When(enum.Enum):
    """Which values are served."""

    ALWAYS = "always"
    SET = "set"  # not None
    NONZERO = "nonzero"  # true (nonzero, non-empty)


@dataclass(frozen=True)
class From:
    """Where a family's values come from: one sample per item of `scope` (attribute paths are
    read with operator.attrgetter, e.g. "stats.gaps" on a StreamView).

    `value`: the sample's value (a path, a function of the item, or a constant). `each`:
    instead, a dict on the item, one sample per key (sorted, after the `first` keys, which are
    always served, 0 when missing), the key being label `key` (by default the family's last
    label). `fixed`: instead, one sample per (label value, path). `labels`: (label, path) of
    labels read off the item other than the scope's own and the item's attributes of the same
    name (`medium`, `endpoint`, ...). `only`: items whose attribute at that path (or whose
    function) is true. `when`: which values are served. The row's `stale` says whether items
    that are down are.
    """

    scope: Scope
    value: str | int | Callable[[Any], Any] = ""
    when: When = When.ALWAYS
    each: str = ""
    first: tuple[str, ...] = ()
    key: str = ""
    fixed: tuple[tuple[str, str], ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    only: str | Callable[[Any], object] = ""


# (label values in the family's label order, value) of a fleet-level family, for one view
FleetSamples = Callable[[FleetView, list[CollectorView]], Iterable[tuple[tuple[str, ...], Any]]]


@dataclass(frozen=True)
class FromFleet:
    """Where a fleet-level family's values come from: read off the whole view every scrape
    (`order`: the collectors, live ones first)."""

    samples: FleetSamples


@dataclass(frozen=True)
class MetricDef:
    """One exported family: its exposed name (counters end in _total), type, labels and help."""

    name: str
    type: str  # counter, gauge, histogram
    labels: tuple[str, ...]
    help: str
    source: From | FromFleet | None = None  # None: served by the aggregator itself (extras)
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

    @property
    def summed(self) -> bool:
        """Read per stream but served per worker (summed over its ranks) by default."""
        return (
            isinstance(self.source, From)
            and self.source.scope in (Scope.STREAM, Scope.MEDIUM)
            and self.labels[:3] != STREAM
        )

    @property
    def family(self) -> str:
        """The prometheus_client family name (counters without the _total suffix)."""
        if self.type == "counter" and self.name.endswith("_total"):
            return self.name[: -len("_total")]
        return self.name


def _d(
    name: str,
    typ: str,
    labels: tuple[str, ...],
    text: str,
    source: From | FromFleet | None = None,
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
    return MetricDef(name, typ, labels, text, source, stale, timely, per, n, detail, optin, down)


def _st(value: str | int, when: When = When.ALWAYS, **kw: Any) -> From:
    """A stream's value."""
    return From(Scope.STREAM, value, when, **kw)


def _md(value: str, when: When = When.ALWAYS, **kw: Any) -> From:
    """A storage tier's value."""
    return From(Scope.MEDIUM, value, when, **kw)


def _set(scope: Scope, value: str) -> From:
    return From(scope, value, When.SET)


def _worker_trouble(w: Any) -> bool:
    """A worker a collector cannot watch (wire.snapshot.WorkerInfo)."""
    return w.state in WORKER_TROUBLE


def _source_down(s: Any) -> bool:
    """A scheduler source that delivers nothing (wire.snapshot.SourceState)."""
    return s.state in SOURCE_DOWN


def _relay_up(b: Any) -> int:
    """1 while a bound endpoint's relay target is connected and subscribed."""
    return 1 if b.relay.state == "up" else 0


def _unread(m: Any) -> bool:
    """A lower tier with unread blocks now or removed so far (wire.snapshot.MediumStats)."""
    return bool(m.unread_removed_total or m.unread_blocks)


def _owners(v: FleetView, order: list[CollectorView]) -> Iterable[tuple[tuple[str, ...], int]]:
    return (((w, str(r)), len(ids)) for (w, r), ids in sorted(v.owners.items()))


def _last_owners(v: FleetView, order: list[CollectorView]) -> Iterable[tuple[tuple[str, ...], int]]:
    for (w, r), c in sorted(v.last_owner.items()):
        yield (w, str(r), c.info.collector_id, str(c.info.node_rank)), 1


def _placement(attr: str, when: When = When.ALWAYS) -> FromFleet:
    def samples(v: FleetView, order: list[CollectorView]) -> Iterable[tuple[tuple[str], Any]]:
        for w, p in v.placement.items():
            x = getattr(p, attr)
            if when is When.ALWAYS or x is not None:
                yield (w,), x

    return FromFleet(samples)


def _replicated(
    v: FleetView, order: list[CollectorView]
) -> Iterable[tuple[tuple[str, str], float]]:
    for w, p in v.placement.items():
        merged: dict[str, float] = {}
        for m, n in sorted(p.replicated.items()):
            key = str(m) if m < REPLICATED_CAP else f"{REPLICATED_CAP}+"
            merged[key] = merged.get(key, 0.0) + n
        for key, n in merged.items():
            yield (w, key), n


def _lookups(blocks: bool) -> FleetSamples:
    """Each worker's lookups by result (hit, then the kinds of miss), in blocks or tokens."""

    def samples(v: FleetView, order: list[CollectorView]) -> Iterable[tuple[tuple[str, ...], Any]]:
        for name, p in sorted(v.misses.items()):
            for w in p.workers:
                size = 1 if blocks else w.block_size
                hit = w.hit_blocks if blocks else w.hit_tokens
                if hit is not None:
                    yield (w.worker_id, name, "hit"), hit
                if size:
                    for k in MISS_KINDS:
                        yield (w.worker_id, name, k), w.misses[k] * size

    return samples


POOL_FACTORS = (1.0, 2.0)  # the pool curve's points served by default (the API has them all)


def _factor(m: float) -> str:
    """A capacity factor as a label value: 1, 1.25, +Inf."""
    return "+Inf" if math.isinf(m) else f"{m:g}"


def _pool_curve(
    v: FleetView, order: list[CollectorView]
) -> Iterable[tuple[tuple[str, str], float]]:
    for name, pc in sorted(v.capacity.items()):
        for m in POOL_FACTORS:
            pt = pc.pool.point(m)
            if pt is not None and pt.trusted and pt.hit_rate is not None:
                yield (name, _factor(m)), pt.hit_rate


def _worker_curve(
    v: FleetView, order: list[CollectorView]
) -> Iterable[tuple[tuple[str, str, str], float]]:
    for name, pc in sorted(v.capacity.items()):
        for w in pc.workers:
            for pt in w.points:
                if pt.factor >= 1 and pt.trusted and pt.hit_rate is not None:
                    yield (w.worker_id, name, _factor(pt.factor)), pt.hit_rate


def _untrusted(v: FleetView, order: list[CollectorView]) -> Iterable[tuple[tuple[str, str], int]]:
    for name, p in sorted(v.misses.items()):
        for reason in p.reasons:
            yield (name, reason), 1


_COUNTERS = "snapshot.counters"  # a collector's own counters (None from older collectors)
_INFO = (("engine", "stats.engine"), ("endpoint", "stats.endpoint"), ("topic", "stats.topic"),
         ("collector", "collector.collector_id"))  # fmt: skip

CATALOG: tuple[MetricDef, ...] = (
    # per stream: identity and health
    _d("kvobserve_stream_info", "gauge", (*STREAM, "engine", "endpoint", "topic", "collector"),
       "Always 1; identifies the stream's engine, endpoint, topic and collector.",
       _st(1, labels=_INFO), stale=True),
    _d("kvobserve_stream_up", "gauge", STREAM,
       "1 while the stream is connected, healthy and its collector reports; 0 otherwise.",
       _st("up"), stale=True),
    _d("kvobserve_kv_event_batches_total", "counter", STREAM, "KV-event batches applied.",
       _st("stats.batches_total")),
    _d("kvobserve_kv_events_total", "counter", ("worker_id", "type"),
       "KV events by type, summed over the worker's ranks: stored, removed, cleared (applied); "
       "other_group (vLLM side KV-cache groups, set aside).",
       _st("", each="stats.events", first=EVENT_TYPES),
       per="worker_type", n=3, detail="per_stream_counters"),
    # per stream and medium: the block index
    _d("kvobserve_kv_blocks", "gauge", BLOCK, "Resident blocks in the stream's block index.",
       _md("blocks"), per="medium"),
    _d("kvobserve_kv_tokens", "gauge", BLOCK,
       "Resident tokens: each resident block counts the tokens its BlockStored event gave it "
       "(the event's block_size; SGLang's last page of a request holds fewer than the page "
       "size; Dynamo events carry none: the worker's block_size), so at most blocks x block "
       "size.", _md("tokens"), per="medium"),
    _d("kvobserve_kv_blocks_stored_total", "counter", WORKER_MEDIUM,
       "Blocks stored (BlockStored hashes); summed over the worker's ranks.",
       _md("stored_total"), per="worker_medium", detail="per_stream_counters"),
    _d("kvobserve_kv_blocks_removed_total", "counter", WORKER_MEDIUM,
       "Blocks removed (BlockRemoved hashes); summed over the worker's ranks.",
       _md("removed_total"), per="worker_medium", detail="per_stream_counters"),
    _d("kvobserve_kv_blocks_unchanged_total", "counter", ("worker_id", "kind"),
       "Block hashes in events that changed nothing, summed over the worker's ranks: "
       "already_resident (stored while resident; the first store time is kept), not_resident "
       "(removed while not resident).",
       _st("", fixed=(("already_resident", "stats.already_resident"),
                      ("not_resident", "stats.unknown_removed"))),
       per="worker_type", n=2, detail="per_stream_counters"),
    _d("kvobserve_kv_capacity_tokens", "gauge", STREAM,
       "KV capacity in tokens, from the worker config or the rank's scheduler metrics.",
       _st("capacity_tokens", When.NONZERO)),
    _d("kvobserve_kv_cache_usage_ratio", "gauge", STREAM,
       "Cache usage: GPU-tier resident tokens / capacity (about 1 on any warm prefix cache); "
       "absent while the capacity is unknown. Not token usage.", _st("usage_ratio", When.SET)),
    _d("kvobserve_kv_block_lifetime_seconds", "histogram", WORKER_MEDIUM,
       "Block lifetime: removal time - store time (engine timestamps), over the worker's ranks.",
       _md("lifetime", When.SET), per="histogram", detail="per_stream_histograms"),
    # per stream: sequence accounting
    _d("kvobserve_kv_sequence_gaps_total", "counter", STREAM, "Sequence gaps seen (occurrences).",
       _st("stats.gaps")),
    _d("kvobserve_kv_batches_missed_total", "counter", STREAM, "Batches missing in sequence gaps.",
       _st("stats.missed")),
    _d("kvobserve_kv_batches_recovered_total", "counter", STREAM,
       "Missed batches recovered by replay.", _st("stats.recovered")),
    _d("kvobserve_kv_batches_lost_total", "counter", STREAM, "Missed batches not recovered.",
       _st("stats.lost")),
    _d("kvobserve_kv_replay_requests_total", "counter", (*STREAM, "result"),
       "Replay requests sent, by result.", _st("", each="stats.replay_requests"), per="value"),
    _d("kvobserve_kv_publisher_restarts_total", "counter", STREAM,
       "Publisher restarts (sequence fell back); the block index was reset.",
       _st("stats.restarts")),
    _d("kvobserve_kv_duplicate_batches_total", "counter", STREAM,
       "Batches redelivered with a seen sequence number and payload; ignored.",
       _st("stats.duplicate_batches")),
    _d("kvobserve_kv_duplicate_stream", "gauge", STREAM,
       "1 while interleaved or mirrored publishers are seen on the stream.",
       _st("stats.duplicate_stream")),
    _d("kvobserve_kv_rank_mismatch_batches_total", "counter", STREAM,
       "Batches whose dp rank differs from the rank the port belongs to.",
       _st("stats.rank_mismatch_batches")),
    _d("kvobserve_kv_interleaved_batches_total", "counter", STREAM,
       "Batches of a second publisher interleaved on the stream, dropped (served once seen).",
       _st("stats.interleaved_batches", When.NONZERO), per="fault"),
    # served for a collector that went down too, as its probe found it
    _d("kvobserve_kv_unexpected_stream", "gauge", (*STREAM, "endpoint"),
       "1 while a probed port past the worker's last rank carries events (dp_rank of that port).",
       From(Scope.UNEXPECTED, "active"), stale=True,
       per="fault"),
    _d("kvobserve_kv_decode_errors_total", "counter", (*STREAM, "reason"),
       "Messages that failed to decode, by reason; skipped.",
       _st("", each="stats.decode_errors"), per="value"),
    _d("kvobserve_kv_state_complete", "gauge", STREAM,
       "1 when the block index is known complete; 0 = usage is a lower bound.",
       _st("stats.state_complete")),
    _d("kvobserve_kv_last_batch_timestamp_seconds", "gauge", STREAM,
       "Engine timestamp of the last applied batch (Unix seconds).",
       _st("stats.last_batch_ts", When.NONZERO), timely=True, stale=True),
    _d("kvobserve_kv_event_lag_seconds", "gauge", STREAM,
       "Receive time - engine timestamp of the last batch.", _st("stats.lag_seconds", When.SET),
       timely=True),
    # cache analytics (docs/cache-analytics.md): trust, silent loss, thrash, placement
    _d("kvobserve_kv_view_trust_ranks", "gauge", ("worker_id", "trust"),
       "Ranks of the worker that are up whose block-index view is in each trust state: "
       "complete, replay_filled, partial (a state no rank is in is not served).",
       _st(1, labels=(("trust", "stats.trust"),), only="stats.trust"), stale=False,
       per="worker", down=UP_RANKS),
    _d("kvobserve_kv_silent_loss_evidence_total", "counter", (*STREAM, "reason"),
       "Evidence of KV events lost without a sequence gap, by reason: remove_unknown (blocks "
       "removed that were not resident), parent_unknown (stores whose parent is not resident); "
       "served once nonzero.", _st("", When.NONZERO, each="stats.silent_loss"), per="fault"),
    _d("kvobserve_kv_resident_over_capacity", "gauge", STREAM,
       "1 while the GPU tier's resident tokens exceed the rank's capacity (removals were lost); "
       "served only then.", _st(1, only="over_capacity"), per="fault"),
    _d("kvobserve_kv_blocks_restored_total", "counter", WORKER_MEDIUM,
       "Blocks stored again on the same rank and tier within the restore window (300 s) after "
       "their removal (eviction thrash); summed over the worker's ranks.",
       _md("restored_total"), per="worker_medium"),
    _d("kvobserve_kv_restore_untracked_total", "counter", ("worker_id",),
       "Removals the restore window could not track (its cap), summed over the worker's ranks: "
       "restores are a lower bound once it grows; served once nonzero.",
       _st("stats.restore_refused", When.NONZERO), per="fault"),
    _d("kvobserve_worker_kv_redundancy_ratio", "gauge", ("worker_id",),
       "Top-tier resident blocks summed over the worker's ranks / distinct blocks among them "
       "(1 = no block on two ranks).", _placement("redundancy", When.SET), per="worker",
       optin=CACHE_DETAIL),
    _d("kvobserve_worker_kv_recomputed_elsewhere_total", "counter", ("worker_id",),
       "Blocks stored on a rank while another rank of the worker (in the same collector) held "
       "them (the placement misses within one collector: kvobserve_worker_kv_lookups_total "
       "has them fleet-wide).", _placement("recomputed_elsewhere"), per="worker",
       optin=CACHE_DETAIL),
    # where the misses come from (docs/cache-analytics.md): per worker, summed per pool
    _d("kvobserve_worker_kv_lookups_total", "counter", ("worker_id", "pool", "result"),
       "Prefix-cache lookups of the worker's ranks in blocks (the engine's pages), by result: "
       "hit (the engine's prefix-cache hit tokens / block size; absent while unknown), and "
       "each miss (a top-tier store) by kind: compulsory (never resident in the pool before), "
       "capacity (resident before, evicted everywhere since), placement (resident on another "
       "rank of the pool then). Misses: the hash sample's estimate since the aggregator "
       "started; sum by pool for the pool.", FromFleet(_lookups(blocks=True)), per="worker",
       n=4),
    _d("kvobserve_worker_kv_lookup_tokens_total", "counter", ("worker_id", "pool", "result"),
       "kvobserve_worker_kv_lookups_total in tokens (misses x block size: where it is known).",
       FromFleet(_lookups(blocks=False)), per="worker", n=4, optin=CACHE_DETAIL),
    _d("kvobserve_pool_kv_miss_split_untrusted", "gauge", ("pool", "reason"),
       "1 while the pool's miss split is outside its stated bound, by reason: collector_down, "
       "rank_partial (a rank down or its block index partial), deltas_lost (until a full "
       "resync), few_samples (fewer than 4,000 sampled misses); served only then.",
       FromFleet(_untrusted), per="fault"),
    _d("kvobserve_pool_kv_miss_share_bound", "gauge", ("pool",),
       "95 % half-width of the widest share of the pool's misses by kind since its start "
       "(0-1), from the sample itself.",
       FromFleet(lambda v, _: (((p.pool,), p.bound) for _, p in sorted(v.misses.items()))),
       per="worker", optin=CACHE_DETAIL),
    # what more memory would buy (docs/cache-analytics.md): a few points per pool
    _d("kvobserve_pool_kv_hit_ratio_at_capacity", "gauge", ("pool", "factor"),
       "The hit ratio (0-1) the pool would have had as one cache of factor x its ranks' total "
       "KV capacity (1: the same memory shared; 2: doubled), whatever the routing: from its "
       "evictions and the engines' hit counters, since the aggregator started; served only "
       "while the point is trusted (/api/v1/capacity has every point and why).",
       FromFleet(_pool_curve), per="worker", n=len(POOL_FACTORS)),
    _d("kvobserve_worker_kv_hit_ratio_at_capacity", "gauge", ("worker_id", "pool", "factor"),
       "The hit ratio (0-1) the worker would have had with factor x each rank's KV capacity, "
       "for the routing that was observed (1: measured; +Inf: unlimited); never a pool's "
       "what-if under a cache-aware router. Served only while the point is trusted.",
       FromFleet(_worker_curve), per="worker", n=7, optin=CACHE_DETAIL),
    _d("kvobserve_kv_block_restore_gap_seconds", "histogram", ("worker_id",),
       "Removal-to-restore time of restored blocks, over the worker's ranks and tiers.",
       From(Scope.MEDIUM, "restore_gap", When.SET), per="worker", n=17, optin=CACHE_DETAIL),
    _d("kvobserve_kv_tier_moves_total", "counter", ("worker_id", "from", "to"),
       "Blocks stored on tier `to` that tier `from` of the same rank held or had just removed "
       "(GPU to CPU: offload; CPU to GPU: onboard), summed over the worker's ranks.",
       From(Scope.MEDIUM, each="moved_in", key="from", labels=(("to", "medium"),)),
       per="worker", n=2, optin=CACHE_DETAIL),
    _d("kvobserve_kv_tier_unread_blocks", "gauge", WORKER_MEDIUM,
       "Lower-tier resident blocks not read back to the top tier so far, summed over the "
       "worker's ranks.", _md("unread_blocks", only=_unread), stale=False, per="worker",
       optin=CACHE_DETAIL, down=UP_RANKS),
    _d("kvobserve_kv_tier_unread_removed_total", "counter", WORKER_MEDIUM,
       "Lower-tier blocks removed without having been read back, summed over the worker's "
       "ranks.", _md("unread_removed_total", only=_unread), per="worker", optin=CACHE_DETAIL),
    _d("kvobserve_kv_lora_blocks", "gauge", ("worker_id", "medium", "lora_name"),
       "Resident blocks per LoRA adapter (names capped per stream; later ones as _other), "
       "summed over the worker's ranks.", _md("", each="lora_blocks"), stale=False,
       per="worker", optin=CACHE_DETAIL, down=UP_RANKS),
    _d("kvobserve_worker_kv_blocks_distinct", "gauge", ("worker_id",),
       "Distinct top-tier resident blocks over the worker's ranks (a sketch estimate across "
       "collectors).", _placement("blocks_distinct"), per="worker", optin=CACHE_DETAIL),
    _d("kvobserve_worker_kv_blocks_replicated", "gauge", ("worker_id", "ranks"),
       "Distinct top-tier blocks resident on exactly `ranks` ranks of the worker (2, 3, ...; "
       "8 or more as 8+).", FromFleet(_replicated), per="worker", optin=CACHE_DETAIL),
    _d("kvobserve_worker_kv_placement_relative_error", "gauge", ("worker_id",),
       "One standard error of the distinct-block estimate, relative (0 when exact).",
       _placement("relative_error"), per="worker", optin=CACHE_DETAIL),
    # router-index drift (docs/dynamo.md): the last comparison of a router's index with ours
    _d("kvobserve_router_index_phantom_blocks", "gauge", DRIFT,
       "Blocks the router's index holds that the engine evicted (settled blocks only).",
       From(Scope.DRIFT, "phantom"), per="drift"),
    _d("kvobserve_router_index_missing_blocks", "gauge", DRIFT,
       "Blocks the engine holds that the router's index lacks (settled blocks only).",
       From(Scope.DRIFT, "missing"), per="drift"),
    _d("kvobserve_router_index_jaccard", "gauge", DRIFT,
       "Jaccard similarity of the router's and the engine's block sets (method dump only).",
       _set(Scope.DRIFT, "jaccard"), per="drift"),
    _d("kvobserve_router_index_router_blocks", "gauge", DRIFT,
       "Blocks the router's index holds for the stream and tier.",
       From(Scope.DRIFT, "router_blocks"), per="drift"),
    _d("kvobserve_router_index_engine_blocks", "gauge", DRIFT,
       "Blocks kvobserve's event-derived index holds for the stream and tier.",
       From(Scope.DRIFT, "engine_blocks"), per="drift"),
    _d("kvobserve_collector_router_index_comparisons_total", "counter",
       ("collector", "worker_id", "result"),
       "Comparisons with a router or indexer, by result (ok, http, connection, decode, busy).",
       From(Scope.DRIFT_SOURCE, each="comparisons"), per="drift"),
    _d("kvobserve_collector_router_index_last_success_timestamp_seconds", "gauge",
       ("collector", "worker_id"),
       "Time of the last successful comparison with the router (Unix seconds).",
       From(Scope.DRIFT_SOURCE, "last_ok", When.NONZERO), timely=True, per="drift"),
    # fleet: ownership and workers
    _d("kvobserve_dp_rank_owners", "gauge", ("worker_id", "dp_rank"),
       "Live collectors owning the rank (0 = uncovered, >1 = duplicated).", FromFleet(_owners),
       per="stream"),
    _d("kvobserve_dp_rank_last_owner_info", "gauge",
       ("worker_id", "dp_rank", "collector", "node_rank"),
       "Always 1, while no live collector owns the rank: the down collector that owned it "
       "last (DPRankUncovered carries its labels for the inhibition, docs/alerts.md).",
       FromFleet(_last_owners), per="fault"),
    _d("kvobserve_worker_dp_size", "gauge", ("worker_id",), "Declared data-parallel size.",
       FromFleet(lambda v, _: (((w,), n) for w, n in sorted(v.dp_size.items()))), per="worker"),
    _d("kvobserve_worker_leaders", "gauge", ("worker_id",),
       "Live collectors reading the worker's scheduler metrics (should be 1).",
       FromFleet(lambda v, _: (((w,), len(ids)) for w, ids in sorted(v.leaders.items()))),
       per="worker"),
    _d("kvobserve_worker_state", "gauge", ("worker_id", "node_rank", "collector", "state"),
       "1 while a live collector cannot watch a configured worker, by state: undiscovered (no "
       "KV-event stream known: discovery failed or answered nothing usable), layout_mismatch "
       "(the engine's own layout contradicts the config); served only then, the reason is in "
       "/api/v1/fleet.", From(Scope.WORKER, 1, only=_worker_trouble), stale=False,
       per="fault"),
    _d("kvobserve_scheduler_source_state", "gauge",
       ("worker_id", "node_rank", "collector", "source", "state"),
       "1 while a scheduler source of a live collector delivers nothing, by state: down (it "
       "failed, or a heartbeat source sent nothing for 10 intervals), undecodable; served only "
       "then, the reason is in /api/v1/fleet.", From(Scope.SOURCE, 1, only=_source_down),
       stale=False, per="fault"),
    # collectors
    _d("kvobserve_collector_up", "gauge", ("collector", "node_rank", "hostname"),
       "1 while the collector's snapshots arrive; 0 after 3 silent intervals.",
       From(Scope.COLLECTOR, "up"), per="collector"),
    _d("kvobserve_collector_snapshot_age_seconds", "gauge", ("collector",),
       "Seconds since the collector's last snapshot arrived.",
       FromFleet(lambda _, order: (((c.info.collector_id,), c.age_s) for c in order)),
       timely=True, per="collector"),
    _d("kvobserve_collector_start_time_seconds", "gauge", ("collector",),
       "Start time of the collector process (Unix seconds).",
       From(Scope.COLLECTOR, "info.start_time", When.NONZERO), timely=True, per="collector"),
    _d("kvobserve_collector_refused_total", "counter", ("collector", "what"),
       "What a cardinality cap refused: streams (max_streams), medium_events (events of a "
       "storage tier past the per-stream cap), passthrough_samples.",
       From(Scope.COLLECTOR, each="snapshot.refused"), per="fault"),
    _d("kvobserve_collector_messages_received_total", "counter", ("collector",),
       "KV-event messages the collector read from its streams and probe ports.",
       From(Scope.COLLECTOR, "snapshot.counters.messages_received", only=_COUNTERS),
       per="collector"),
    _d("kvobserve_collector_ingest_errors_total", "counter", ("collector",),
       "Turns of the collector's ingest loop that failed (logged; the loop goes on); served "
       "once nonzero.",
       From(Scope.COLLECTOR, "snapshot.counters.ingest_errors", When.NONZERO, only=_COUNTERS),
       per="fault"),
    _d("kvobserve_collector_publish_dropped_total", "counter", ("collector", "reason"),
       "Snapshots the collector could not publish, by reason (closed, buffer_full, too_large, "
       "error); reported with its next snapshot that arrives.",
       From(Scope.COLLECTOR, each="snapshot.counters.publish_dropped", only=_COUNTERS),
       per="fault"),
    # bind mode (docs/deployment.md): the endpoints a collector binds, per rank, and their relays
    _d("kvobserve_bind_publishers", "gauge", (*BOUND, "endpoint"),
       "Connections open on an endpoint the collector binds for publishers to connect to.",
       From(Scope.BIND, "publishers"), stale=False, per="bind"),
    _d("kvobserve_bind_messages_total", "counter", BOUND,
       "Messages received on the bound endpoint.", From(Scope.BIND, "messages_total"),
       per="bind"),
    _d("kvobserve_bind_skipped_total", "counter", (*BOUND, "reason"),
       "Messages of the bound endpoint that no stream took, by reason: topic_mismatch (the "
       "topic does not fit the worker's topic), refused (a new publisher past max_streams), "
       "analysis_behind (relayed, but the analysis was behind: its stream sees a gap); served "
       "once nonzero.", From(Scope.BIND, each="skipped"), per="bind"),
    _d("kvobserve_relay_up", "gauge", (*BOUND, "target"),
       "1 while the relay target of the bound endpoint is connected and subscribed.",
       From(Scope.BIND, _relay_up, labels=(("target", "relay.target"),), only="relay"),
       stale=False, per="bind"),
    _d("kvobserve_relay_forwarded_total", "counter", BOUND,
       "Frames forwarded unchanged to the relay target.",
       From(Scope.BIND, "relay.forwarded", only="relay"), per="bind"),
    _d("kvobserve_relay_dropped_total", "counter", (*BOUND, "reason"),
       "Frames not forwarded to the relay target, by reason: no_target (none connected and "
       "subscribed), queue_full (relay_queue frames already waiting for it).",
       From(Scope.BIND, each="relay.dropped", first=RELAY_DROP_REASONS, only="relay"),
       per="bind"),
    # scheduler metrics per rank, joined across collectors, under the node that owns the rank
    _d("kvobserve_scheduler_running_requests", "gauge", STREAM, "Running requests of the rank.",
       _set(Scope.SCHEDULER, "running_requests"), down=SCHEDULER),
    _d("kvobserve_scheduler_queued_requests", "gauge", STREAM, "Queued requests of the rank.",
       _set(Scope.SCHEDULER, "queued_requests"), down=SCHEDULER),
    _d("kvobserve_scheduler_token_usage_ratio", "gauge", STREAM,
       "Token usage: KV held by the rank's running requests / capacity, as its scheduler "
       "reports it (0-1). Not cache usage.", _set(Scope.SCHEDULER, "token_usage_ratio"),
       down=SCHEDULER),
    _d("kvobserve_scheduler_cache_hit_ratio", "gauge", STREAM, "Prefix cache hit ratio (0-1).",
       _set(Scope.SCHEDULER, "cache_hit_ratio"), down=SCHEDULER),
    _d("kvobserve_scheduler_max_total_tokens", "gauge", STREAM,
       "KV capacity in tokens as the scheduler reports it.",
       _set(Scope.SCHEDULER, "max_total_tokens"), down=SCHEDULER),
    _d("kvobserve_scheduler_source_errors_total", "counter",
       ("worker_id", "node_rank", "source", "reason"),
       "Scheduler-source messages a collector could not use (e.g. reason pickle_refused), by "
       "node, source (metrics, load, kv_metrics, fpm) and reason.",
       From(Scope.SOURCE_ERROR, "count"), per="fault"),
    # the aggregator itself (export/prometheus.py aggregator_metrics)
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
    _d("kvobserve_build_info", "gauge", ("version",), "Always 1; the kvobserve version.",
       FromFleet(lambda v, _: [((__version__,), 1)])),
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
