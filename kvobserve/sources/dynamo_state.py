"""Per-stream and per-plane state of the Dynamo source, and what it hands to snapshots and drift."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.sources.dynamo_plan import DynamoPlan
from kvobserve.sources.plan import StreamSpec
from kvobserve.sources.stream_state import WatchedStream
from kvobserve.wire.kv_events import DEFAULT_MAX_PAYLOAD, BlockHash
from kvobserve.wire.snapshot import (
    DynamoPlaneStats,
    DynamoStreamStats,
    SchedulerStats,
    StreamStats,
    WorkerInfo,
)

Key = tuple[str, int]  # (kvobserve worker_id, dp_rank)
_MAX_PUBLISHERS = 8  # envelope cursors kept per stream (restarts add one each)


@dataclass(frozen=True)
class DynamoOptions:
    """Tunables of the Dynamo source."""

    max_streams: int = 4096  # across every plane of the collector: a label cardinality cap
    quiet_s: float = 30.0  # a stream with no message this long is down (load beats every 10 s)
    forget_after_s: float = 300.0  # ... and forgotten after this long
    max_payload: int = DEFAULT_MAX_PAYLOAD


class DynamoStream:
    """One (worker, dp_rank) stream of a Dynamo plane."""

    __slots__ = (
        "dup_pid",
        "dynamo_worker_id",
        "env",
        "env_dups",
        "env_gaps",
        "env_missed",
        "header_mismatch",
        "pid",
        "pids_seen",
        "plan",
        "touched",
        "unsettled",
        "watched",
    )

    def __init__(
        self, plan: DynamoPlan, spec: StreamSpec, dynamo_worker_id: int, wall: float = 0.0
    ) -> None:
        self.plan = plan
        self.watched = WatchedStream(spec, StreamSequencer(spec.dp_rank, replay=False), wall)
        self.dynamo_worker_id = dynamo_worker_id
        self.env: dict[int, int] = {}  # publisher_id -> last envelope sequence
        self.pid = 0
        self.pids_seen = self.env_gaps = self.env_missed = self.env_dups = 0
        self.header_mismatch = 0
        self.dup_pid = False
        self.touched: set[BlockHash] | None = None  # a drift comparison is watching
        self.unsettled = False  # a clear or restart during the comparison

    @property
    def seq(self) -> StreamSequencer:
        """The stream's sequencer (always set for Dynamo streams)."""
        sq = self.watched.seq
        assert sq is not None
        return sq

    def envelope(self, pid: int, sequence: int, now: float) -> None:
        """Track one message's envelope (publisher id, per-publisher sequence)."""
        env = self.env
        last = env.get(pid)
        if last is None:
            self.pids_seen += 1
            if len(env) >= _MAX_PUBLISHERS:
                del env[next(iter(env))]
        elif sequence == last + 1:
            pass
        elif sequence > last:
            self.env_gaps += 1
            self.env_missed += sequence - last - 1
        else:
            self.env_dups += 1
        if last is not None and pid != self.pid and self.pid in env:
            # a publisher we knew speaks again after another one: both are alive
            self.seq.mark_duplicate_stream(now)
        env[pid] = max(sequence, last if last is not None else sequence)
        self.pid = pid


@dataclass
class PlaneState:
    """Counters and connection state of one plane."""

    plan: DynamoPlan
    connected: set[str] = field(default_factory=set)  # NATS: {url}; ZMQ: connected endpoints
    messages_total: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    not_owned_events: int = 0

    def count(self, reason: str, n: int = 1) -> None:
        """Count `n` messages (or events) that could not be used, by reason."""
        self.errors[reason] = self.errors.get(reason, 0) + n


@dataclass
class Touched:
    """One stream at the end of a drift window."""

    dynamo_worker_id: int
    resident: dict[str, set[BlockHash]]  # medium -> blocks, as of the end of the window
    touched: set[BlockHash]  # stored or removed during the window
    unsettled: bool  # cleared or restarted during the window: not comparable this time
    complete: bool


@dataclass
class DynamoStats:
    """The Dynamo parts of one snapshot."""

    streams: list[StreamStats]
    dynamo: list[DynamoStreamStats]
    scheduler: list[SchedulerStats]
    workers: list[WorkerInfo]
    planes: list[DynamoPlaneStats]
    refused_streams: int = 0


def touch(st: DynamoStream, events: Sequence[object]) -> None:
    touched = st.touched
    assert touched is not None
    for ev in events:
        kind = getattr(ev, "kind", "")
        if kind in ("BlockStored", "BlockRemoved"):
            touched.update(ev.block_hashes)  # type: ignore[attr-defined]
        else:  # a clear: every block of the stream may have changed
            st.unsettled = True
