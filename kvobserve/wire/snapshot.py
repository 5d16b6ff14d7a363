"""kvobserve's own versioned snapshot message: one collector's cumulative state, every interval.

Snapshots are msgpack (msgspec), map-encoded so that a newer collector can add fields with
defaults and an older aggregator ignores them. Counters are cumulative since the collector
started (`CollectorInfo.start_time`), so a lost snapshot only delays what the aggregator shows.
"""

from __future__ import annotations

import msgspec
from msgspec import Struct

from kvobserve.wire.capacity import RankCurveStats
from kvobserve.wire.errors import WireError, decode
from kvobserve.wire.misses import MissDelta

# 2: a collector sends one part per shard bucket of its workers (`bucket`, `buckets`); a
# version-1 snapshot is read as one whole part (bucket -1). docs/nats.md, docs/scale.md.
SNAPSHOT_VERSION = 2
READABLE_VERSIONS = frozenset({1, 2})
BUCKETS = 64  # shard buckets of workers (worker_bucket), whatever the number of shards
WHOLE = -1  # the bucket of a snapshot that is not split (version 1, or a collector's local view)
MAX_SNAPSHOT_BYTES = 64 * 1024 * 1024
MAX_EVENTS = 64  # recent events carried in every snapshot


class Histogram(Struct, array_like=True, gc=False):
    """A cumulative histogram: counts[i] observations <= bounds[i]; +Inf is `count`."""

    bounds: list[float]
    counts: list[int]
    count: int = 0
    sum: float = 0.0


class MediumStats(Struct, omit_defaults=True, gc=False):
    """Block index state of one storage tier of one stream (docs/cache-analytics.md)."""

    medium: str
    blocks: int = 0
    tokens: int = 0
    stored_total: int = 0
    removed_total: int = 0
    lifetime: Histogram | None = None
    restored_total: int = 0  # blocks stored again within the restore window after removal
    restore_gap: Histogram | None = None  # removal -> restore seconds
    moved_in: dict[str, int] = {}  # source medium -> blocks stored here that it held or dropped
    unread_removed_total: int = 0  # lower tiers: blocks that left without being read back
    unread_blocks: int = 0  # lower tiers: resident blocks not read back (yet)
    lora_blocks: dict[str, int] = {}  # LoRA adapter -> resident blocks (capped names)


class HotBlock(Struct, array_like=True, gc=False):
    """One hot prefix: a block hash (never tokens), its store count, the ranks holding it now."""

    hash: int | bytes
    stores: int  # a lower bound; at most `StreamStats.hot_error` more
    holders: int = 0  # ranks of this worker in this collector where it is resident now


class StreamStats(Struct, omit_defaults=True, gc=False):
    """One (worker_id, dp_rank) KV-event stream as seen by one collector."""

    worker_id: str
    dp_rank: int
    engine: str = ""
    endpoint: str = ""
    topic: str = ""
    up: bool = False
    batches_total: int = 0
    events: dict[str, int] = {}  # type (stored, removed, cleared) -> count
    media: list[MediumStats] = []
    gaps: int = 0
    missed: int = 0
    recovered: int = 0
    lost: int = 0
    replay_requests: dict[str, int] = {}  # result -> count
    restarts: int = 0
    duplicate_batches: int = 0
    duplicate_stream: bool = False
    rank_mismatch_batches: int = 0
    decode_errors: dict[str, int] = {}  # reason -> count
    interleaved_batches: int = 0  # a second publisher's batches on this stream, dropped
    already_resident: int = 0  # stored hashes that were resident already (first store time kept)
    unknown_removed: int = 0  # removed hashes that were not resident
    state_complete: bool = False
    last_batch_ts: float = 0.0  # engine timestamp of the last applied batch; 0 = none yet
    lag_seconds: float | None = None  # receive time - engine timestamp of the last batch
    # Why the stream is (not) up: docs/collector.md "Stream states". Times are the collector's
    # wall clock; 0 = never.
    state: str = ""  # connecting, not_publisher, undecodable, wrong_topic, waiting, up, idle, ...
    reason: str = ""  # one line for a person: "connection refused", "no batch for 12 s", ...
    state_since: float = 0.0
    events_per_s: float | None = None  # over the last snapshot interval
    last_message_time: float = 0.0
    last_gap_time: float = 0.0
    last_loss_time: float = 0.0
    last_restart_time: float = 0.0
    last_duplicate_time: float = 0.0  # last evidence of a second publisher
    duplicate_since: float = 0.0  # first evidence of the current one (0: none now, or unknown)
    last_decode_error_time: float = 0.0
    last_rank_mismatch_time: float = 0.0
    incomplete_reason: str = ""  # why state_complete is False, when known
    replaying: bool = False  # a replay is in flight: whether the index will be complete is open
    # docs/cache-analytics.md; empty/0 with the analytics off
    trust: str = ""  # complete, replay_filled, partial ("" = an older collector)
    trust_reason: str = ""
    silent_loss: dict[str, int] = {}  # reason (remove_unknown, parent_unknown) -> count
    last_silent_loss_time: float = 0.0  # collector wall clock when silent_loss last grew
    restore_refused: int = 0  # removals the restore window could not track (its cap)
    recomputed_elsewhere: int = 0  # blocks stored here while another rank held them
    hot: list[HotBlock] = []
    hot_error: int = 0  # bound on how far each hot store count may fall short
    lora_refused: int = 0  # stores of adapters past the name cap (counted as "_other")
    block_size: int = 0  # tokens per block of the stream's events (the usual one); 0: none yet
    # analysis/vouch.py: whether the index can vouch for its blocks, tokens and usage (an older
    # collector: as state_complete says), why, since when (wall clock), and what is certainly
    # resident meanwhile (the top tier's tokens and blocks: a lower bound while unvouched)
    vouched: bool = True
    vouch_reason: str = ""
    vouched_since: float = 0.0
    lower_tokens: int = 0
    lower_blocks: int = 0


class WorkerPlacement(Struct, omit_defaults=True, gc=False):
    """Top-tier residency across the ranks of one worker that one collector watches.

    Exact over `ranks`. For a worker whose ranks span collectors, `sketch` carries the
    `sketch_k` smallest normalized hashes of the union (8 bytes big-endian each, ascending) and
    `sketch_counts` how many of `ranks` hold each (2 bytes each); the aggregator merges them.
    """

    worker_id: str
    ranks: list[int] = []
    blocks_sum: int = 0  # resident blocks summed over ranks
    blocks_distinct: int = 0  # distinct hashes over ranks
    replicated: dict[int, int] = {}  # m >= 2 ranks holding it -> distinct blocks
    recomputed_elsewhere: int = 0  # summed over ranks (cumulative)
    sketch_k: int = 0
    sketch: bytes = b""
    sketch_counts: bytes = b""
    computed_at: float = 0.0  # monotonic seconds of the collector when computed


class UnexpectedStream(Struct, omit_defaults=True, gc=False):
    """Traffic seen on a probed port past a worker's last rank."""

    worker_id: str
    dp_rank: int  # the rank the port would belong to (>= dp_size)
    endpoint: str
    batches_total: int = 0
    active: bool = False


class SchedulerStats(Struct, omit_defaults=True, gc=False):
    """Normalized scheduler metrics of one DP rank; None where unknown."""

    worker_id: str
    dp_rank: int
    source: str = ""  # metrics, load, kv_metrics, fpm; several `+`-joined (load+metrics)
    running_requests: float | None = None
    queued_requests: float | None = None
    token_usage_ratio: float | None = None
    cache_hit_ratio: float | None = None
    max_total_tokens: float | None = None
    updated: float = 0.0  # wall-clock time of the last update


class PrefixCounters(Struct, array_like=True, gc=False):
    """The engine's prefix-cache counters of one rank as its /metrics last said (cumulative
    tokens; dp_rank -1: the whole worker's, SGLang's tokenizer): the miss split's hits."""

    worker_id: str
    dp_rank: int
    hit_tokens: float
    query_tokens: float


class SourceErrors(Struct, array_like=True, gc=False):
    """Messages a scheduler source of a worker could not use, by reason (cumulative)."""

    worker_id: str
    source: str  # metrics, load, kv_metrics, fpm
    reason: str  # a WireError reason, or connection/http/parse for the /metrics scrape
    count: int


class SourceState(Struct, omit_defaults=True, gc=False):
    """The health of one scheduler source of a worker (state words as for streams)."""

    worker_id: str
    source: str  # metrics, load, kv_metrics, fpm
    endpoint: str = ""
    state: str = ""  # waiting, up, idle, down, undecodable
    reason: str = ""
    since: float = 0.0  # wall-clock time the state began
    messages_total: int = 0


class Event(Struct, omit_defaults=True, gc=False):
    """One recent happening on a stream or source, as the collector saw it."""

    seq: int  # per collector process, from 1: the aggregator keeps each event once
    time: float  # the collector's wall clock
    kind: str  # state, gap, join, restart, duplicate, decode_errors, rank_mismatch, source
    worker_id: str = ""
    dp_rank: int | None = None
    message: str = ""
    first_seq: int | None = None  # gaps: the seq range missed
    last_seq: int | None = None


class WorkerInfo(Struct, omit_defaults=True, gc=False):
    """What a collector declares about a worker it watches."""

    worker_id: str
    engine: str = ""
    dp_size: int = 0
    ranks_owned: list[int] = []
    leader: bool = False
    capacity_tokens: int = 0  # configured; 0 = take it from scheduler metrics
    # Whether this collector can watch the worker as configured (docs/collector.md "Worker
    # states"): undiscovered, layout_mismatch, watching; "" = an older collector.
    state: str = ""
    reason: str = ""  # one line: "connection refused at http://10.0.0.5:30000/server_info"
    since: float = 0.0  # wall-clock time the state began
    elsewhere: list[int] = []  # ranks the config gives this node that its engine does not run
    kv_bytes_per_token: int = 0  # configured; 0: the curve's capacities in tokens only
    tier_tokens: int = 0  # configured: the offload tier whose worth the curve says; 0: none


class DynamoStreamStats(Struct, omit_defaults=True, gc=False):
    """What the Dynamo event plane adds to one (worker_id, dp_rank) stream (docs/dynamo.md)."""

    worker_id: str
    dp_rank: int
    dynamo_worker_id: int = 0  # Dynamo's own worker (instance) id
    publisher_id: int = 0  # the envelope publisher of the last message
    publishers_seen: int = 0  # distinct publisher ids (a restart adds one; two live = duplicate)
    envelope_gaps: int = 0  # envelope sequence jumps of one publisher (messages lost)
    envelope_missed: int = 0  # envelope sequences skipped
    envelope_duplicates: int = 0  # (publisher_id, sequence) seen again
    header_mismatches: int = 0  # ZMQ header frames that disagree with the envelope
    replay: str = "unavailable"  # the event plane has no replay: a gap stays lost
    last_message_age_s: float | None = None  # since any message of this stream (events, load)


class DynamoPlaneStats(Struct, omit_defaults=True, gc=False):
    """One configured Dynamo event plane (a `[[worker]]` with `engine = "dynamo"`)."""

    worker_id: str  # the config id; its streams are `{worker_id}/{dynamo worker id}`
    event_plane: str = ""  # nats | zmq
    url: str = ""  # NATS URL (credentials removed) or the ZMQ endpoints, comma-separated
    connected: bool = False
    messages_total: int = 0
    errors: dict[str, int] = {}  # reason -> messages that could not be used
    not_owned_events: int = 0  # events of ranks another collector keeps (keep_ranks = "node")


RELAY_DROP_REASONS = ("no_target", "queue_full")  # why a relay did not forward a frame


class RelayStats(Struct, omit_defaults=True, gc=False):
    """A bound endpoint's relay: every frame forwarded to `target` first (docs/deployment.md)."""

    target: str
    state: str = ""  # connecting, waiting (connected, not subscribed), up, not_subscriber
    reason: str = ""
    since: float = 0.0  # wall-clock time the state began
    forwarded: int = 0  # frames sent to the target
    filtered: int = 0  # frames whose topic the target does not subscribe to (not sent)
    dropped: dict[str, int] = {}  # reason (no_target, queue_full) -> frames not forwarded
    last_drop_time: float = 0.0  # collector wall clock of the last drop; 0 = never
    queue: int = 0  # frames that may wait for the target (relay_queue)


class BindStats(Struct, omit_defaults=True, gc=False):
    """One endpoint a collector binds for publishers to connect to (bind mode), per rank."""

    worker_id: str  # the [[worker]] id; with a topic template its streams are `{id}/{pod}`
    dp_rank: int
    endpoint: str = ""
    topic: str = ""  # the topic template, or the prefix
    state: str = ""  # listening, connected, bind_failed
    reason: str = ""
    since: float = 0.0
    publishers: int = 0  # connections open on the endpoint now
    messages_total: int = 0
    skipped: dict[str, int] = {}  # reason (topic_mismatch, refused, analysis_behind) -> messages
    skip_reason: str = ""  # the last message skipped, for a person
    streams: int = 0  # streams it feeds now
    relay: RelayStats | None = None


class DriftStats(Struct, omit_defaults=True, gc=False):
    """Router-index drift of one (worker_id, dp_rank, medium), from the last comparison."""

    worker_id: str
    dp_rank: int
    medium: str
    method: str = "dump"  # dump: block sets compared; size: only the router's tree size
    router_blocks: int = 0  # blocks the router's index holds for this stream and medium
    engine_blocks: int = 0  # blocks kvobserve's event-derived index holds
    phantom: int = 0  # the router holds them, the engine evicted them
    missing: int = 0  # the engine holds them, the router lacks them
    in_flight: int = 0  # changed while comparing: counted neither way
    jaccard: float | None = None  # |both| / |either| over settled blocks; None for `size`
    complete: bool = False  # kvobserve's index saw this stream from a known start, no loss
    at: float = 0.0  # wall time of the router's answer


class DriftSource(Struct, omit_defaults=True, gc=False):
    """One router or indexer URL that drift is measured against."""

    worker_id: str  # the config id of the Dynamo plane
    url: str
    method: str = "dump"
    comparisons: dict[str, int] = {}  # result (ok, http, connection, decode, busy) -> count
    last_ok: float = 0.0  # wall time of the last successful comparison
    duration_s: float = 0.0  # of the last successful comparison, window included
    unseen_streams: int = 0  # (worker, rank) the router holds that kvobserve never saw


class Sample(Struct, array_like=True, gc=False):
    """One passthrough sample: full name, labels, value."""

    name: str
    labels: dict[str, str]
    value: float


class Family(Struct, omit_defaults=True, gc=False):
    """One passthrough engine metric family, labels already extended."""

    name: str
    type: str
    help: str = ""
    samples: list[Sample] = []


class CollectorCounters(Struct, omit_defaults=True, gc=False):
    """The collector's own work, cumulative since it started."""

    messages_received: int = 0  # KV-event messages read from every stream and probe
    ingest_errors: int = 0  # turns of the ingest loop that failed (logged, the loop goes on)
    snapshots_published: int = 0
    publish_dropped: dict[str, int] = {}  # snapshots the transport could not send, by reason


class CheckpointStats(Struct, omit_defaults=True, gc=False):
    """The collector's checkpoints of its streams (docs/reliability.md, "Restarts of
    kvobserve"): whether they are written, and what was found at start."""

    state: str = "ok"  # ok | failing (cannot write: `reason`) | off (checkpoint_interval_s 0)
    reason: str = ""  # failing: read_only, no_space, in_use, io
    detail: str = ""  # one line: the path and the error
    since: float = 0.0  # wall-clock time the state began
    written: int = 0  # checkpoint files written since the collector started
    errors: dict[str, int] = {}  # writes that failed, by reason
    loaded: int = 0  # checkpoints read at start and accepted for their stream
    refused: dict[str, int] = {}  # checkpoints read at start and not trusted, by reason
    round_seconds: float = 0.0  # the last round: from its first copy to the directory's fsync

    @property
    def failing(self) -> dict[str, int]:
        """{reason: 1} while checkpoints cannot be written, else {} (one sample per reason)."""
        return {self.reason: 1} if self.state == "failing" else {}


class CollectorInfo(Struct, omit_defaults=True, gc=False):
    """The collector's identity."""

    collector_id: str
    node_rank: int = 0
    hostname: str = ""
    start_time: float = 0.0
    cluster: str = ""
    version: str = ""


class Snapshot(Struct, omit_defaults=True, gc=False):
    """One collector's full state at `time` (wall clock)."""

    collector: CollectorInfo
    version: int = SNAPSHOT_VERSION
    seq: int = 0  # snapshots sent by this collector process, from 0
    time: float = 0.0
    interval_s: float = 1.0
    workers: list[WorkerInfo] = []
    streams: list[StreamStats] = []
    unexpected: list[UnexpectedStream] = []
    scheduler: list[SchedulerStats] = []
    scheduler_errors: list[SourceErrors] = []
    passthrough: list[Family] = []
    refused: dict[str, int] = {}  # what a cardinality cap refused -> count (streams, ...)
    dynamo: list[DynamoStreamStats] = []
    dynamo_planes: list[DynamoPlaneStats] = []
    drift: list[DriftStats] = []
    drift_sources: list[DriftSource] = []
    binds: list[BindStats] = []  # bind mode: the endpoints this collector binds, per rank
    counters: CollectorCounters | None = None
    sources: list[SourceState] = []
    events: list[Event] = []  # the collector's most recent events (at most MAX_EVENTS)
    placement: list[WorkerPlacement] = []  # per worker, with the analytics on
    bucket: int = WHOLE  # the shard bucket of every worker in this part; WHOLE: all of them
    buckets: list[int] = []  # every bucket this collector sent a part for, with the same seq
    prefix: list[PrefixCounters] = []  # the engines' prefix-cache counters (the leader's scrape)
    misses: list[MissDelta] = []  # the miss split's sampled changes, one per pool (and resyncs)
    checkpoint: CheckpointStats | None = None  # None: a collector without checkpoints (older)
    curves: list[RankCurveStats] = []  # per rank, every curve interval (wire/capacity.py)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Snapshot)


def encode_snapshot(snap: Snapshot) -> bytes:
    """Snapshot -> msgpack bytes."""
    return _encoder.encode(snap)


def decode_snapshot(data: bytes) -> Snapshot:
    """msgpack bytes -> Snapshot; raises WireError only."""
    snap: Snapshot = decode(_decoder, data, "snapshot", MAX_SNAPSHOT_BYTES)
    if snap.version not in READABLE_VERSIONS:
        raise WireError("schema", f"snapshot version {snap.version} != {SNAPSHOT_VERSION}")
    if not WHOLE <= snap.bucket < BUCKETS:
        raise WireError("schema", f"snapshot bucket {snap.bucket} not in -1..{BUCKETS - 1}")
    return snap
