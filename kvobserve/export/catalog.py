"""The metric catalog: one row per family (name, type, labels, help, where its values come from).

/metrics (both the prometheus_client collector and the cached text), OTLP and docs/metrics.md are
all read off this table; export/series.py reads each row's values off a FleetView.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from kvobserve import __version__
from kvobserve.analysis.conditions import SOURCE_DOWN, WORKER_TROUBLE
from kvobserve.analysis.placement import PlacementEstimate
from kvobserve.analysis.views import KINDS as MISS_KINDS
from kvobserve.analysis.views import CollectorView, FleetView, StreamView
from kvobserve.wire.snapshot import (
    RELAY_DROP_REASONS,
    BindStats,
    CollectorCounters,
    DriftSource,
    DriftStats,
    Histogram,
    MediumStats,
    RelayStats,
    SchedulerStats,
    SourceErrors,
    SourceState,
    UnexpectedStream,
    WorkerInfo,
)

STREAM = ("worker_id", "node_rank", "dp_rank")
BLOCK = (*STREAM, "medium")
WORKER_MEDIUM = ("worker_id", "medium")
DRIFT = (*STREAM, "medium", "method")
BOUND = ("collector", "worker_id", "dp_rank")  # an endpoint a collector binds (bind mode)
# The "while down" cells of families whose rule `stale` alone does not tell (docs/metrics.md)
UP_RANKS = "up ranks only"
VOUCHED = "absent, also while unvouched"  # served while the index vouches (analysis/vouch.py)
SCHEDULER = "absent, also when stale"
EVENT_TYPES = ("stored", "removed", "cleared")  # always served, in this order, before the others
REPLICATED_CAP = 8  # blocks on this many ranks or more share one `ranks` label value ("8+")

T = TypeVar("T")
# A sample's value: a number (a flag is served as 1 or 0), a histogram; None: not set (When.SET)
Value = float | Histogram | None


class Scope(Generic[T]):
    """What one sample of a family stands for: an item, of type T, of a collector's part of the
    view (Scope.STREAM: analysis.views.StreamView, ...).

    Each item gives its labels by name: `labels` reads the item's own; export/series.py adds its
    collector's (`collector`, `node_rank`) or, for an item that is `part_of` an item of another
    scope (a stream's storage tier, a bound endpoint's relay), that item's labels.
    """

    STREAM: ClassVar[Scope[StreamView]]  # `stats`: wire.snapshot.StreamStats
    MEDIUM: ClassVar[Scope[MediumStats]]  # a storage tier of a stream (up while its stream is)
    SCHEDULER: ClassVar[Scope[SchedulerStats]]  # joined per rank (fresh ones only)
    UNEXPECTED: ClassVar[Scope[UnexpectedStream]]
    DRIFT: ClassVar[Scope[DriftStats]]  # while its collector and stream are up
    DRIFT_SOURCE: ClassVar[Scope[DriftSource]]  # while its collector is up
    COLLECTOR: ClassVar[Scope[CollectorView]]
    COUNTERS: ClassVar[Scope[CollectorCounters]]  # a collector's own (none from older ones)
    SOURCE_ERROR: ClassVar[Scope[SourceErrors]]
    WORKER: ClassVar[Scope[WorkerInfo]]  # up while its collector is
    SOURCE: ClassVar[Scope[SourceState]]  # a scheduler source (up while its collector is)
    BIND: ClassVar[Scope[BindStats]]  # an endpoint bound (up while its collector is)
    RELAY: ClassVar[Scope[RelayStats]]  # a bound endpoint's relay, where it has one

    def __init__(
        self,
        name: str,
        labels: Mapping[str, Callable[[T], object]],
        part_of: Scope[Any] | None = None,
    ) -> None:
        self.name = name
        self.labels = dict(labels)
        self.part_of = part_of

    def __repr__(self) -> str:
        return f"Scope.{self.name.upper()}"


Scope.STREAM = Scope(
    "stream", {"worker_id": lambda s: s.stats.worker_id, "dp_rank": lambda s: s.stats.dp_rank}
)
Scope.MEDIUM = Scope("medium", {"medium": lambda m: m.medium}, part_of=Scope.STREAM)
Scope.SCHEDULER = Scope(
    "scheduler", {"worker_id": lambda s: s.worker_id, "dp_rank": lambda s: s.dp_rank}
)
Scope.UNEXPECTED = Scope(
    "unexpected",
    {"worker_id": lambda u: u.worker_id, "dp_rank": lambda u: u.dp_rank,
     "endpoint": lambda u: u.endpoint},
)  # fmt: skip
Scope.DRIFT = Scope(
    "drift",
    {"worker_id": lambda d: d.worker_id, "dp_rank": lambda d: d.dp_rank,
     "medium": lambda d: d.medium, "method": lambda d: d.method},
)  # fmt: skip
Scope.DRIFT_SOURCE = Scope("drift_source", {"worker_id": lambda d: d.worker_id})
Scope.COLLECTOR = Scope(
    "collector",
    {"collector": lambda c: c.info.collector_id, "node_rank": lambda c: c.info.node_rank,
     "hostname": lambda c: c.info.hostname},
)  # fmt: skip
Scope.COUNTERS = Scope("counters", {}, part_of=Scope.COLLECTOR)
Scope.SOURCE_ERROR = Scope(
    "source_error",
    {"worker_id": lambda e: e.worker_id, "source": lambda e: e.source,
     "reason": lambda e: e.reason},
)  # fmt: skip
Scope.WORKER = Scope("worker", {"worker_id": lambda w: w.worker_id, "state": lambda w: w.state})
Scope.SOURCE = Scope(
    "source",
    {"worker_id": lambda s: s.worker_id, "source": lambda s: s.source,
     "state": lambda s: s.state},
)  # fmt: skip
Scope.BIND = Scope(
    "bind",
    {"worker_id": lambda b: b.worker_id, "dp_rank": lambda b: b.dp_rank,
     "endpoint": lambda b: b.endpoint},
)  # fmt: skip
Scope.RELAY = Scope("relay", {"target": lambda r: r.target}, part_of=Scope.BIND)
SCOPES: tuple[Scope[Any], ...] = (
    Scope.STREAM, Scope.MEDIUM, Scope.SCHEDULER, Scope.UNEXPECTED, Scope.DRIFT,
    Scope.DRIFT_SOURCE, Scope.COLLECTOR, Scope.COUNTERS, Scope.SOURCE_ERROR, Scope.WORKER,
    Scope.SOURCE, Scope.BIND, Scope.RELAY,
)  # fmt: skip


class When(enum.Enum):
    """Which values are served."""

    ALWAYS = "always"
    SET = "set"  # not None
    NONZERO = "nonzero"  # true (nonzero, non-empty)


@dataclass(frozen=True)
class From(Generic[T]):
    """Where a family's values come from: one sample per item of `scope`, read by functions of
    the item (typed: mypy checks them against the scope's items; export/series.py reads a
    function that only reads attributes, e.g. `lambda s: s.stats.gaps`, as operator.attrgetter).

    `value`: the sample's value (a function of the item, or a constant). `each`: instead, a dict
    of the item, one sample per key (sorted, after the `first` keys, which are always served, 0
    when missing), the key being label `key` (by default the family's last label). `fixed`:
    instead, one sample per (label value, function). `labels`: (label, function) of labels
    other than the scope's own. `only`: the items for which the function is true, chosen before
    anything else is read. `when`: which values are served. The row's `stale` says whether items
    that are down are.
    """

    scope: Scope[T]
    value: Callable[[T], Value] | int | None = None
    when: When = When.ALWAYS
    each: Callable[[T], Mapping[str, float]] | None = None
    first: tuple[str, ...] = ()
    key: str = ""
    fixed: tuple[tuple[str, Callable[[T], float]], ...] = ()
    labels: tuple[tuple[str, Callable[[T], object]], ...] = ()
    only: Callable[[T], object] | None = None


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
    source: From[Any] | FromFleet | None = None  # None: served by the aggregator itself (extras)
    # The staleness rule (docs/metrics.md): True: served while the stream is down or its
    # collector gone (counters, health); False: served only while it is up; None: not per stream
    stale: bool | None = None
    timely: bool = False  # value depends on the wall clock (masked in the golden scrape)
    per: str = "fleet"  # what one series stands for: see PER (the series budget)
    n: int = 1  # series per `per`
    # [aggregator] per_stream_detail (docs/metrics.md, series budget): `detail`: summed per
    # worker without it, served per stream with it (labels STREAM+); `detail_only`: served only
    # with it
    detail: bool = False
    detail_only: bool = False
    down: str = ""  # the docs' "while down" cell when `stale` alone does not say it
    # served only while its stream's index vouches for it (analysis/vouch.py): blocks, tokens,
    # cache usage; absent while it cannot, as while the stream is down
    vouched: bool = False

    @property
    def while_down(self) -> str:
        """What /metrics serves of this family while its source is down (docs/metrics.md)."""
        if self.down:
            return self.down
        if self.vouched:
            return VOUCHED
        return "-" if self.stale is None else "kept" if self.stale else "absent"

    @property
    def detail_labels(self) -> tuple[str, ...]:
        """Labels with per_stream_detail: the stream's, plus the one a worker's series keep."""
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
    source: From[T] | FromFleet | None = None,  # From[T], not From[Any]: mypy reads its functions
    *,
    stale: bool | None = None,
    timely: bool = False,
    per: str | None = None,
    n: int = 1,
    detail: bool = False,
    detail_only: bool = False,
    down: str = "",
    vouched: bool = False,
) -> MetricDef:
    if stale is None and (labels[:3] == STREAM or detail):
        # Counters and histograms are cumulative, so a stale value is still true: serve them.
        stale = typ != "gauge"
    if per is None:
        per = "stream" if labels[:3] == STREAM else "fleet"
    return MetricDef(
        name, typ, labels, text, source, stale, timely, per, n, detail, detail_only, down,
        vouched,
    )  # fmt: skip


def _worker_trouble(w: WorkerInfo) -> bool:
    """A worker a collector cannot watch."""
    return w.state in WORKER_TROUBLE


def _source_down(s: SourceState) -> bool:
    """A scheduler source that delivers nothing."""
    return s.state in SOURCE_DOWN


def _unread(m: MediumStats) -> bool:
    """A lower tier with unread blocks now or removed so far."""
    return bool(m.unread_removed_total or m.unread_blocks)


def _owners(v: FleetView, order: list[CollectorView]) -> Iterable[tuple[tuple[str, ...], int]]:
    return (((w, str(r)), len(ids)) for (w, r), ids in sorted(v.owners.items()))


def _last_owners(v: FleetView, order: list[CollectorView]) -> Iterable[tuple[tuple[str, ...], int]]:
    for (w, r), c in sorted(v.last_owner.items()):
        yield (w, str(r), c.info.collector_id, str(c.info.node_rank)), 1


def _placement(
    value: Callable[[PlacementEstimate], float | None], when: When = When.ALWAYS
) -> FromFleet:
    def samples(v: FleetView, order: list[CollectorView]) -> Iterable[tuple[tuple[str], Any]]:
        for w, p in v.placement.items():
            x = value(p)
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


def _checkpoint_failing(c: CollectorView) -> Mapping[str, float]:
    """{reason: 1} while the collector cannot write its checkpoints; {} (older collectors: no
    checkpoint part)."""
    ck = c.snapshot.checkpoint
    return ck.failing if ck is not None else {}


def _prefix_tokens(
    v: FleetView, order: list[CollectorView]
) -> Iterable[tuple[tuple[str, str], float]]:
    """Each worker's prefix-cache hit and queried tokens, as the engine counts them."""
    for _, p in sorted(v.misses.items()):
        for w in p.workers:
            if w.hit_tokens is not None and w.query_tokens is not None:
                yield (w.worker_id, "hit"), w.hit_tokens
                yield (w.worker_id, "queried"), w.query_tokens


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


CATALOG: tuple[MetricDef, ...] = (
    # per stream: identity and health
    _d("kvobserve_stream_info", "gauge", (*STREAM, "engine", "endpoint", "topic", "collector"),
       "Always 1; identifies the stream's engine, endpoint, topic and collector.",
       From(Scope.STREAM, 1, labels=(("engine", lambda s: s.stats.engine),
                                     ("endpoint", lambda s: s.stats.endpoint),
                                     ("topic", lambda s: s.stats.topic))),
       stale=True),
    _d("kvobserve_stream_up", "gauge", STREAM,
       "1 while the stream is connected, healthy and its collector reports; 0 otherwise.",
       From(Scope.STREAM, lambda s: s.up), stale=True),
    _d("kvobserve_kv_event_batches_total", "counter", STREAM, "KV-event batches applied.",
       From(Scope.STREAM, lambda s: s.stats.batches_total)),
    _d("kvobserve_kv_events_total", "counter", ("worker_id", "type"),
       "KV events by type, summed over the worker's ranks: stored, removed, cleared (applied); "
       "other_group (vLLM side KV-cache groups, set aside).",
       From(Scope.STREAM, None, each=lambda s: s.stats.events, first=EVENT_TYPES),
       per="worker_type", n=3, detail=True),
    # per stream and medium: the block index
    _d("kvobserve_kv_blocks", "gauge", BLOCK,
       "Resident blocks in the stream's block index; absent while the index cannot vouch for "
       "them (kvobserve_kv_index_unvouched: kvobserve_kv_blocks_lower_bound instead).",
       From(Scope.MEDIUM, lambda m: m.blocks), per="medium", vouched=True),
    _d("kvobserve_kv_tokens", "gauge", BLOCK,
       "Resident tokens: each resident block counts the tokens its BlockStored event gave it "
       "(the event's block_size; SGLang's last page of a request holds fewer than the page "
       "size; Dynamo events carry none: the worker's block_size), so at most blocks x block "
       "size. Absent while the index cannot vouch for them (kvobserve_kv_tokens_lower_bound).",
       From(Scope.MEDIUM, lambda m: m.tokens), per="medium", vouched=True),
    _d("kvobserve_kv_index_unvouched", "gauge", STREAM,
       "1 while the stream's block index cannot vouch for its blocks, tokens and cache usage "
       "(joined mid-stream, lost batches, resuming from a checkpoint, ... and not shown whole "
       "since: docs/cache-analytics.md): they are absent then, their lower bounds served "
       "instead; absent while it can.",
       From(Scope.STREAM, 1, only=lambda s: not s.stats.vouched), per="fault"),
    _d("kvobserve_kv_tokens_lower_bound", "gauge", STREAM,
       "While the index cannot vouch for itself: top-tier tokens certainly resident in the "
       "engine (what the index holds, less what it may hold after a loss).",
       From(Scope.STREAM, lambda s: s.stats.lower_tokens, only=lambda s: not s.stats.vouched),
       per="fault"),
    _d("kvobserve_kv_blocks_lower_bound", "gauge", STREAM,
       "While the index cannot vouch for itself: top-tier blocks certainly resident in the "
       "engine.",
       From(Scope.STREAM, lambda s: s.stats.lower_blocks, only=lambda s: not s.stats.vouched),
       per="fault"),
    _d("kvobserve_kv_blocks_stored_total", "counter", WORKER_MEDIUM,
       "Blocks stored (BlockStored hashes); summed over the worker's ranks.",
       From(Scope.MEDIUM, lambda m: m.stored_total), per="worker_medium", detail=True),
    _d("kvobserve_kv_blocks_removed_total", "counter", WORKER_MEDIUM,
       "Blocks removed (BlockRemoved hashes); summed over the worker's ranks.",
       From(Scope.MEDIUM, lambda m: m.removed_total), per="worker_medium", detail=True),
    _d("kvobserve_kv_blocks_unchanged_total", "counter", ("worker_id", "kind"),
       "Block hashes in events that changed nothing, summed over the worker's ranks: "
       "already_resident (stored while resident; the first store time is kept), not_resident "
       "(removed while not resident).",
       From(Scope.STREAM, fixed=(("already_resident", lambda s: s.stats.already_resident),
                                ("not_resident", lambda s: s.stats.unknown_removed))),
       per="worker_type", n=2, detail=True),
    _d("kvobserve_kv_capacity_tokens", "gauge", STREAM,
       "KV capacity in tokens, from the worker config or the rank's scheduler metrics.",
       From(Scope.STREAM, lambda s: s.capacity_tokens, When.NONZERO)),
    _d("kvobserve_kv_cache_usage_ratio", "gauge", STREAM,
       "Cache usage: GPU-tier resident tokens / capacity (about 1 on any warm prefix cache); "
       "absent while the capacity is unknown or the index cannot vouch for its tokens. Not "
       "token usage.",
       From(Scope.STREAM, lambda s: s.usage_ratio, When.SET), vouched=True),
    _d("kvobserve_kv_block_lifetime_seconds", "histogram", WORKER_MEDIUM,
       "Block lifetime: removal time - store time (engine timestamps), over the worker's ranks.",
       From(Scope.MEDIUM, lambda m: m.lifetime, When.SET), per="histogram", detail=True),
    # per stream: sequence accounting
    _d("kvobserve_kv_sequence_gaps_total", "counter", STREAM, "Sequence gaps seen (occurrences).",
       From(Scope.STREAM, lambda s: s.stats.gaps)),
    _d("kvobserve_kv_batches_missed_total", "counter", STREAM, "Batches missing in sequence gaps.",
       From(Scope.STREAM, lambda s: s.stats.missed)),
    _d("kvobserve_kv_batches_recovered_total", "counter", STREAM,
       "Missed batches recovered by replay.", From(Scope.STREAM, lambda s: s.stats.recovered)),
    _d("kvobserve_kv_batches_lost_total", "counter", STREAM, "Missed batches not recovered.",
       From(Scope.STREAM, lambda s: s.stats.lost)),
    _d("kvobserve_kv_replay_requests_total", "counter", (*STREAM, "result"),
       "Replay requests sent, by result.",
       From(Scope.STREAM, None, each=lambda s: s.stats.replay_requests), per="value"),
    _d("kvobserve_kv_publisher_restarts_total", "counter", STREAM,
       "Publisher restarts (sequence fell back); the block index was reset.",
       From(Scope.STREAM, lambda s: s.stats.restarts)),
    _d("kvobserve_kv_duplicate_batches_total", "counter", STREAM,
       "Batches redelivered with a seen sequence number and payload; ignored.",
       From(Scope.STREAM, lambda s: s.stats.duplicate_batches)),
    _d("kvobserve_kv_duplicate_stream", "gauge", STREAM,
       "1 while interleaved or mirrored publishers are seen on the stream.",
       From(Scope.STREAM, lambda s: s.stats.duplicate_stream)),
    _d("kvobserve_kv_rank_mismatch_batches_total", "counter", STREAM,
       "Batches whose dp rank differs from the rank the port belongs to.",
       From(Scope.STREAM, lambda s: s.stats.rank_mismatch_batches)),
    _d("kvobserve_kv_interleaved_batches_total", "counter", STREAM,
       "Batches of a second publisher interleaved on the stream, dropped (served once seen).",
       From(Scope.STREAM, lambda s: s.stats.interleaved_batches, When.NONZERO), per="fault"),
    # served for a collector that went down too, as its probe found it
    _d("kvobserve_kv_unexpected_stream", "gauge", (*STREAM, "endpoint"),
       "1 while a probed port past the worker's last rank carries events (dp_rank of that port).",
       From(Scope.UNEXPECTED, lambda u: u.active), stale=True,
       per="fault"),
    _d("kvobserve_kv_decode_errors_total", "counter", (*STREAM, "reason"),
       "Messages that failed to decode, by reason; skipped.",
       From(Scope.STREAM, None, each=lambda s: s.stats.decode_errors), per="value"),
    _d("kvobserve_kv_state_complete", "gauge", STREAM,
       "1 when the block index is known complete; 0 = usage is a lower bound.",
       From(Scope.STREAM, lambda s: s.stats.state_complete)),
    _d("kvobserve_kv_last_batch_timestamp_seconds", "gauge", STREAM,
       "Engine timestamp of the last applied batch (Unix seconds).",
       From(Scope.STREAM, lambda s: s.stats.last_batch_ts, When.NONZERO), timely=True, stale=True),
    _d("kvobserve_kv_event_lag_seconds", "gauge", STREAM,
       "Receive time - engine timestamp of the last batch.",
       From(Scope.STREAM, lambda s: s.stats.lag_seconds, When.SET),
       timely=True),
    # cache analytics (docs/cache-analytics.md): trust, silent loss, thrash, placement
    _d("kvobserve_kv_view_trust_ranks", "gauge", ("worker_id", "trust"),
       "Ranks of the worker by the trust state of their block-index view: complete, "
       "replay_filled, partial, and unknown (down, or its collector silent: not known now) "
       "(a state no rank is in is not served).",
       From(Scope.STREAM, 1, labels=(("trust", lambda s: s.view_trust),),
            only=lambda s: s.view_trust), stale=True,
       per="worker", down="down ranks as unknown"),
    _d("kvobserve_kv_silent_loss_evidence_total", "counter", (*STREAM, "reason"),
       "Evidence of KV events lost without a sequence gap, by reason: remove_unknown (blocks "
       "removed that were not resident), parent_unknown (stores whose parent is not resident); "
       "served once nonzero.",
       From(Scope.STREAM, None, When.NONZERO, each=lambda s: s.stats.silent_loss), per="fault"),
    _d("kvobserve_kv_resident_over_capacity", "gauge", STREAM,
       "1 while the GPU tier's resident tokens exceed the rank's capacity (removals were lost); "
       "served only then.", From(Scope.STREAM, 1, only=lambda s: s.over_capacity), per="fault"),
    _d("kvobserve_kv_blocks_restored_total", "counter", WORKER_MEDIUM,
       "Blocks stored again on the same rank and tier within the restore window (300 s) after "
       "their removal (eviction thrash); summed over the worker's ranks.",
       From(Scope.MEDIUM, lambda m: m.restored_total), per="worker_medium"),
    _d("kvobserve_kv_restore_untracked_total", "counter", ("worker_id",),
       "Removals the restore window could not track (its cap), summed over the worker's ranks: "
       "restores are a lower bound once it grows; served once nonzero.",
       From(Scope.STREAM, lambda s: s.stats.restore_refused, When.NONZERO), per="fault"),
    _d("kvobserve_worker_kv_redundancy_ratio", "gauge", ("worker_id",),
       "Top-tier resident blocks summed over the worker's ranks / distinct blocks among them "
       "(1 = no block on two ranks).", _placement(lambda p: p.redundancy, When.SET), per="worker",
       detail_only=True),
    _d("kvobserve_worker_kv_recomputed_elsewhere_total", "counter", ("worker_id",),
       "Blocks stored on a rank while another rank of the worker (in the same collector) held "
       "them (the placement misses within one collector: kvobserve_worker_kv_lookups_total "
       "has them fleet-wide).", _placement(lambda p: p.recomputed_elsewhere), per="worker",
       detail_only=True),
    # where the misses come from (docs/cache-analytics.md): per worker, summed per pool
    _d("kvobserve_worker_kv_lookups_total", "counter", ("worker_id", "pool", "result"),
       "Prefix-cache lookups of the worker's ranks in blocks (the engine's pages), by result: "
       "hit (the engine's prefix-cache hit tokens / block size; absent while unknown), and "
       "each miss (a top-tier store) by kind: compulsory (never resident in the pool before), "
       "capacity (resident before, evicted everywhere since), placement (resident on another "
       "rank of the pool then). Misses: the hash sample's estimate since the aggregator "
       "started; sum by pool for the pool.", FromFleet(_lookups(blocks=True)), per="worker",
       n=4),
    _d("kvobserve_worker_prefix_cache_tokens_total", "counter", ("worker_id", "tokens"),
       "The engine's own prefix-cache counters in tokens, hit and queried (vLLM "
       "prefix_cache_hits and prefix_cache_queries summed over the worker's ranks; SGLang "
       "cached_tokens and prompt_tokens, its tokenizer's), as its /metrics last said; absent "
       "while unknown. rate(hit) / rate(queried) is the engine's hit rate over any window "
       "(kvobserve_scheduler_cache_hit_ratio is SGLang's last prefill batch's; "
       "kvobserve_worker_kv_lookups_total counts stored generated tokens as misses too).",
       FromFleet(_prefix_tokens), per="worker", n=2),
    _d("kvobserve_worker_kv_lookup_tokens_total", "counter", ("worker_id", "pool", "result"),
       "kvobserve_worker_kv_lookups_total in tokens (misses x block size: where it is known).",
       FromFleet(_lookups(blocks=False)), per="worker", n=4, detail_only=True),
    _d("kvobserve_pool_kv_miss_split_untrusted", "gauge", ("pool", "reason"),
       "1 while the pool's miss split is outside its stated bound, by reason: collector_down, "
       "rank_partial (a rank down or its block index partial), deltas_lost (until a full "
       "resync), few_samples (fewer than 4,000 sampled misses); served only then.",
       FromFleet(_untrusted), per="fault"),
    _d("kvobserve_pool_kv_miss_share_bound", "gauge", ("pool",),
       "99 % half-width of the widest share of the pool's misses by kind since its start "
       "(0-1), from the sample itself (over draws of the sample: one workload's estimate errs "
       "the same way in every run).",
       FromFleet(lambda v, _: (((p.pool,), p.bound) for _, p in sorted(v.misses.items()))),
       per="worker", detail_only=True),
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
       FromFleet(_worker_curve), per="worker", n=7, detail_only=True),
    _d("kvobserve_kv_block_restore_gap_seconds", "histogram", ("worker_id",),
       "Removal-to-restore time of restored blocks, over the worker's ranks and tiers.",
       From(Scope.MEDIUM, lambda m: m.restore_gap, When.SET), per="worker", n=17, detail_only=True),
    _d("kvobserve_kv_tier_moves_total", "counter", ("worker_id", "from", "to"),
       "Blocks stored on tier `to` that tier `from` of the same rank held or had just removed "
       "(GPU to CPU: offload; CPU to GPU: onboard), summed over the worker's ranks.",
       From(Scope.MEDIUM, each=lambda m: m.moved_in, key="from",
            labels=(("to", lambda m: m.medium),)),
       per="worker", n=2, detail_only=True),
    _d("kvobserve_kv_tier_unread_blocks", "gauge", WORKER_MEDIUM,
       "Lower-tier resident blocks not read back to the top tier so far, summed over the "
       "worker's ranks.", From(Scope.MEDIUM, lambda m: m.unread_blocks, only=_unread),
       stale=False, per="worker",
       detail_only=True, down=UP_RANKS),
    _d("kvobserve_kv_tier_unread_removed_total", "counter", WORKER_MEDIUM,
       "Lower-tier blocks removed without having been read back, summed over the worker's "
       "ranks.", From(Scope.MEDIUM, lambda m: m.unread_removed_total, only=_unread),
       per="worker", detail_only=True),
    _d("kvobserve_kv_lora_blocks", "gauge", ("worker_id", "medium", "lora_name"),
       "Resident blocks per LoRA adapter (names capped per stream; later ones as _other), "
       "summed over the worker's ranks.", From(Scope.MEDIUM, None, each=lambda m: m.lora_blocks),
       stale=False,
       per="worker", detail_only=True, down=UP_RANKS),
    _d("kvobserve_worker_kv_blocks_distinct", "gauge", ("worker_id",),
       "Distinct top-tier resident blocks over the worker's ranks (a sketch estimate across "
       "collectors).", _placement(lambda p: p.blocks_distinct), per="worker", detail_only=True),
    _d("kvobserve_worker_kv_blocks_replicated", "gauge", ("worker_id", "ranks"),
       "Distinct top-tier blocks resident on exactly `ranks` ranks of the worker (2, 3, ...; "
       "8 or more as 8+).", FromFleet(_replicated), per="worker", detail_only=True),
    _d("kvobserve_worker_kv_placement_relative_error", "gauge", ("worker_id",),
       "One standard error of the distinct-block estimate, relative (0 when exact).",
       _placement(lambda p: p.relative_error), per="worker", detail_only=True),
    # router-index drift (docs/dynamo.md): the last comparison of a router's index with ours
    _d("kvobserve_router_index_phantom_blocks", "gauge", DRIFT,
       "Blocks the router's index holds that the engine evicted (settled blocks only).",
       From(Scope.DRIFT, lambda d: d.phantom), per="drift"),
    _d("kvobserve_router_index_missing_blocks", "gauge", DRIFT,
       "Blocks the engine holds that the router's index lacks (settled blocks only).",
       From(Scope.DRIFT, lambda d: d.missing), per="drift"),
    _d("kvobserve_router_index_jaccard", "gauge", DRIFT,
       "Jaccard similarity of the router's and the engine's block sets (method dump only).",
       From(Scope.DRIFT, lambda d: d.jaccard, When.SET), per="drift"),
    _d("kvobserve_router_index_router_blocks", "gauge", DRIFT,
       "Blocks the router's index holds for the stream and tier.",
       From(Scope.DRIFT, lambda d: d.router_blocks), per="drift"),
    _d("kvobserve_router_index_engine_blocks", "gauge", DRIFT,
       "Blocks kvobserve's event-derived index holds for the stream and tier.",
       From(Scope.DRIFT, lambda d: d.engine_blocks), per="drift"),
    _d("kvobserve_collector_router_index_comparisons_total", "counter",
       ("collector", "worker_id", "result"),
       "Comparisons with a router or indexer, by result (ok, http, connection, decode, busy).",
       From(Scope.DRIFT_SOURCE, each=lambda d: d.comparisons), per="drift"),
    _d("kvobserve_collector_router_index_last_success_timestamp_seconds", "gauge",
       ("collector", "worker_id"),
       "Time of the last successful comparison with the router (Unix seconds).",
       From(Scope.DRIFT_SOURCE, lambda d: d.last_ok, When.NONZERO), timely=True, per="drift"),
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
       From(Scope.COLLECTOR, lambda c: c.up), per="collector"),
    _d("kvobserve_collector_snapshot_age_seconds", "gauge", ("collector",),
       "Seconds since the collector's last snapshot arrived.",
       FromFleet(lambda _, order: (((c.info.collector_id,), c.age_s) for c in order)),
       timely=True, per="collector"),
    _d("kvobserve_collector_start_time_seconds", "gauge", ("collector",),
       "Start time of the collector process (Unix seconds).",
       From(Scope.COLLECTOR, lambda c: c.info.start_time, When.NONZERO), timely=True,
       per="collector"),
    _d("kvobserve_collector_refused_total", "counter", ("collector", "what"),
       "What a cardinality cap refused: streams (max_streams), medium_events (events of a "
       "storage tier past the per-stream cap), passthrough_samples.",
       From(Scope.COLLECTOR, each=lambda c: c.snapshot.refused), per="fault"),
    _d("kvobserve_collector_messages_received_total", "counter", ("collector",),
       "KV-event messages the collector read from its streams and probe ports.",
       From(Scope.COUNTERS, lambda k: k.messages_received),
       per="collector"),
    _d("kvobserve_collector_ingest_errors_total", "counter", ("collector",),
       "Turns of the collector's ingest loop that failed (logged; the loop goes on); served "
       "once nonzero.",
       From(Scope.COUNTERS, lambda k: k.ingest_errors, When.NONZERO),
       per="fault"),
    _d("kvobserve_collector_publish_dropped_total", "counter", ("collector", "reason"),
       "Snapshots the collector could not publish, by reason (closed, buffer_full, too_large, "
       "error); reported with its next snapshot that arrives.",
       From(Scope.COUNTERS, each=lambda k: k.publish_dropped),
       per="fault"),
    _d("kvobserve_collector_checkpoint_failing", "gauge", ("collector", "reason"),
       "1 while the collector cannot write its streams' checkpoints to its state_dir, by reason "
       "(read_only, no_space, in_use, io); absent while they are written (docs/reliability.md).",
       From(Scope.COLLECTOR, each=_checkpoint_failing), per="fault"),
    # bind mode (docs/deployment.md): the endpoints a collector binds, per rank, and their relays
    _d("kvobserve_bind_publishers", "gauge", (*BOUND, "endpoint"),
       "Connections open on an endpoint the collector binds for publishers to connect to.",
       From(Scope.BIND, lambda b: b.publishers), stale=False, per="bind"),
    _d("kvobserve_bind_messages_total", "counter", BOUND,
       "Messages received on the bound endpoint.", From(Scope.BIND, lambda b: b.messages_total),
       per="bind"),
    _d("kvobserve_bind_skipped_total", "counter", (*BOUND, "reason"),
       "Messages of the bound endpoint that no stream took, by reason: topic_mismatch (the "
       "topic does not fit the worker's topic), refused (a new publisher past max_streams), "
       "analysis_behind (relayed, but the analysis was behind: its stream sees a gap); served "
       "once nonzero.", From(Scope.BIND, each=lambda b: b.skipped), per="bind"),
    _d("kvobserve_relay_up", "gauge", (*BOUND, "target"),
       "1 while the relay target of the bound endpoint is connected and subscribed.",
       From(Scope.RELAY, lambda r: int(r.state == "up")),
       stale=False, per="bind"),
    _d("kvobserve_relay_forwarded_total", "counter", BOUND,
       "Frames forwarded unchanged to the relay target.",
       From(Scope.RELAY, lambda r: r.forwarded), per="bind"),
    _d("kvobserve_relay_dropped_total", "counter", (*BOUND, "reason"),
       "Frames not forwarded to the relay target, by reason: no_target (none connected and "
       "subscribed), queue_full (relay_queue frames already waiting for it).",
       From(Scope.RELAY, each=lambda r: r.dropped, first=RELAY_DROP_REASONS),
       per="bind"),
    # scheduler metrics per rank, joined across collectors, under the node that owns the rank
    _d("kvobserve_scheduler_running_requests", "gauge", STREAM, "Running requests of the rank.",
       From(Scope.SCHEDULER, lambda s: s.running_requests, When.SET), down=SCHEDULER),
    _d("kvobserve_scheduler_queued_requests", "gauge", STREAM, "Queued requests of the rank.",
       From(Scope.SCHEDULER, lambda s: s.queued_requests, When.SET), down=SCHEDULER),
    _d("kvobserve_scheduler_token_usage_ratio", "gauge", STREAM,
       "Token usage: KV held by the rank's running requests / capacity, as its scheduler "
       "reports it (0-1). Not cache usage.",
       From(Scope.SCHEDULER, lambda s: s.token_usage_ratio, When.SET),
       down=SCHEDULER),
    _d("kvobserve_scheduler_cache_hit_ratio", "gauge", STREAM, "Prefix cache hit ratio (0-1).",
       From(Scope.SCHEDULER, lambda s: s.cache_hit_ratio, When.SET), down=SCHEDULER),
    _d("kvobserve_scheduler_max_total_tokens", "gauge", STREAM,
       "KV capacity in tokens as the scheduler reports it.",
       From(Scope.SCHEDULER, lambda s: s.max_total_tokens, When.SET), down=SCHEDULER),
    _d("kvobserve_scheduler_source_errors_total", "counter",
       ("worker_id", "node_rank", "source", "reason"),
       "Scheduler-source messages a collector could not use (e.g. reason pickle_refused), by "
       "node, source (metrics, load, kv_metrics, fpm) and reason.",
       From(Scope.SOURCE_ERROR, lambda e: e.count), per="fault"),
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
