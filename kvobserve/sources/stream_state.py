"""The state of one watched KV-event stream (owned by the stream core) and its snapshot form."""

from __future__ import annotations

import time
from collections import deque

from kvobserve.analysis.checkpoint import StreamCopy, copy_stream, state_mark
from kvobserve.analysis.mirror import MirrorDetector
from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.analysis.vouch import Vouch
from kvobserve.engines import profile
from kvobserve.sources.checkpoint_store import identity_of
from kvobserve.sources.health import UP_STATES, Health
from kvobserve.sources.link import Link, LinkTimes
from kvobserve.sources.plan import StreamSpec
from kvobserve.sources.stream_events import RecentEvents, StreamHistory
from kvobserve.wire.snapshot import Histogram, MediumStats, StreamStats

RATE_WINDOW_S = 1.0  # events/s is measured over at least this long


class WatchedStream:
    """State of one watched endpoint, owned by the ingest thread."""

    __slots__ = (
        "bad_seqs",
        "batches",
        "capacity",
        "config",
        "connected",
        "decode_errors",
        "duplicate_wall",
        "history",
        "last_lag",
        "last_seen",
        "link",
        "mirror",
        "open",
        "rate",
        "rate_prev",
        "seq",
        "source",
        "spec",
        "vouch",
    )

    def __init__(self, spec: StreamSpec, seq: StreamSequencer | None, wall: float = 0.0) -> None:
        self.spec = spec
        self.seq = seq  # None for probe ports
        self.open = False  # its SUB is open (connect mode; the shell holds the socket)
        self.config = ""  # its worker's config fingerprint ("": no checkpoints)
        self.vouch = Vouch(now=wall)  # whether its index vouches for its numbers (vouch.py)
        # the engine's KV capacity in tokens and when it was sampled (wall clock), if known
        self.capacity: tuple[float, float] | None = None
        # a pod of a bound endpoint: the connection (the shell's id for it, e.g. its fd) its
        # messages arrive on, once known (sources/bind.py)
        self.source: int | None = None
        self.mirror: MirrorDetector | None = None
        self.decode_errors: dict[str, int] = {}
        self.bad_seqs: deque[int] = deque(maxlen=64)  # seqs that did not decode, live or replay
        self.batches = 0  # probe ports: KV batches seen
        self.last_seen = 0.0  # monotonic time of the last message
        self.last_lag: float | None = None
        self.connected = False  # streams without a Link (Dynamo planes) say so themselves
        self.link: Link | None = None  # None for probe ports
        self.history: StreamHistory | None = None
        self.rate_prev: tuple[float, int] | None = None  # (now, events) when `rate` was taken
        self.rate: float | None = None  # events/s over the last RATE_WINDOW_S or more
        # (monotonic, wall) start of the current duplicate-stream episode: the wall time is
        # taken once, so every snapshot carries the same `duplicate_since`
        self.duplicate_wall: tuple[float, float] | None = None

    # --- what the checkpoint writer reads (sources/checkpoint_writer.py Checkpointable) -----

    @property
    def checkpoint_key(self) -> tuple[str, int]:
        """(worker_id, dp_rank): the file its checkpoint is written to."""
        return self.spec.key

    def checkpoint_mark(self) -> object:
        """Changes whenever what its checkpoint would hold does."""
        return state_mark(self.seq) if self.seq is not None else None

    def checkpoint_copy(self) -> StreamCopy | None:
        """A consistent copy of its state; None while there is nothing to resume from (no batch
        yet, or restored and not confirmed: its file already holds that)."""
        sq = self.seq
        if sq is None or sq.resuming:
            return None
        return copy_stream(identity_of(self.spec), sq, sq.last_payload or None, self.config)


def new_link(spec: StreamSpec, times: LinkTimes, events: RecentEvents, wall: float) -> Link:
    """A stream's Link; its state changes are logged once each and become events."""

    startup = [True]  # until the first change: connecting -> waiting -> up is no news

    def changed(h: Health, before: str) -> None:
        if h.state in UP_STATES and (before in UP_STATES or startup[0]):
            return  # logged, but only a move into or out of trouble is an event
        startup[0] = False
        msg = f"{before} -> {h.state}: {h.reason}"
        events.add("state", msg, worker_id=spec.worker_id, dp_rank=spec.dp_rank, at=h.since)

    name = f"stream {spec.worker_id} rank {spec.dp_rank} ({spec.endpoint})"
    health = Health(name, "starting", "connecting", wall, changed)
    return Link(spec.endpoint, spec.topic, health, times, bound=spec.bound)


def stream_stats(
    st: WatchedStream, sq: StreamSequencer, now: float, wall: float | None = None
) -> StreamStats:
    """The snapshot form of one stream (`now` monotonic, `wall` the same instant, default now)."""
    wall = time.time() if wall is None else wall
    idx = sq.index
    blocks, tokens = idx.blocks, idx.tokens
    stored, removed, lifetimes = idx.stored_total, idx.removed_total, idx.lifetime
    media = []
    for medium in sorted(blocks):
        h = lifetimes[medium]
        cum = h.cumulative()
        media.append(
            MediumStats(
                medium,
                blocks[medium],
                tokens[medium],
                stored[medium],
                removed[medium],
                Histogram([b for b, _ in cum[:-1]], [c for _, c in cum[:-1]], h.count, h.sum),
            )
        )
    spec = st.spec
    events_total = sum(idx.events_total.values())
    if st.rate_prev is None:
        st.rate_prev = (now, events_total)
    elif now - st.rate_prev[0] >= RATE_WINDOW_S:  # snapshots may come faster than this
        st.rate = (events_total - st.rate_prev[1]) / (now - st.rate_prev[0])
        st.rate_prev = (now, events_total)
    link, hist = st.link, st.history
    last = hist.last if hist is not None else {}
    dup, began = sq.duplicate_stream(now), sq.duplicate_stream_began
    if not dup or began is None:
        st.duplicate_wall = None
    elif st.duplicate_wall is None or st.duplicate_wall[0] != began:
        st.duplicate_wall = (began, wall - (now - began))
    v = st.vouch
    if profile(spec.engine).full_blocks_only and idx.block_size:
        v.min_block_tokens = idx.block_size
    if st.capacity is not None:
        v.on_capacity(*st.capacity)
    verdict = v.update_from(wall, sq)
    return StreamStats(
        spec.worker_id,
        spec.dp_rank,
        engine=spec.engine,
        endpoint=spec.endpoint,
        topic=spec.topic,
        up=link.health.up if link is not None else st.connected,
        batches_total=sq.batches_applied,
        events=idx.events_total,
        media=media,
        gaps=sq.gaps,
        missed=sq.missed,
        recovered=sq.recovered,
        lost=sq.lost,
        replay_requests={k: v for k, v in sq.replay_requests.items() if v},
        restarts=sq.restarts,
        duplicate_batches=sq.duplicate_batches,
        duplicate_stream=dup,
        rank_mismatch_batches=sq.rank_mismatch_batches,
        decode_errors=dict(st.decode_errors),
        interleaved_batches=sq.interleaved_batches,
        already_resident=idx.store_of_resident_total,
        unknown_removed=idx.remove_of_unknown_total,
        state_complete=sq.state_complete,
        last_batch_ts=sq.last_ts or 0.0,
        lag_seconds=st.last_lag,
        state=link.health.state if link is not None else "",
        reason=link.reason_now(now) if link is not None else "",
        state_since=link.health.since if link is not None else 0.0,
        events_per_s=st.rate,
        last_message_time=wall - (now - st.last_seen) if st.last_seen else 0.0,
        last_gap_time=last.get("gap", 0.0),
        last_loss_time=last.get("loss", 0.0),
        last_restart_time=last.get("restart", 0.0),
        last_duplicate_time=last.get("duplicate", 0.0),
        duplicate_since=st.duplicate_wall[1] if st.duplicate_wall is not None else 0.0,
        last_decode_error_time=last.get("decode_error", 0.0),
        last_rank_mismatch_time=last.get("rank_mismatch", 0.0),
        incomplete_reason=hist.incomplete_reason if hist is not None else "",
        replaying=sq.replay_in_flight is not None,
        block_size=idx.block_size,
        vouched=verdict.vouched,
        vouch_reason=verdict.reason,
        vouched_since=verdict.since,
        lower_tokens=verdict.lower_tokens,
        lower_blocks=verdict.lower_blocks,
    )
