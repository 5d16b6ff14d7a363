"""The state of one watched KV-event endpoint (owned by the ingest thread) and its snapshot form."""

from __future__ import annotations

from collections import deque

import zmq

from kvobserve.analysis.mirror import MirrorDetector
from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.sources.plan import StreamSpec
from kvobserve.wire.snapshot import Histogram, MediumStats, StreamStats


class WatchedStream:
    """State of one watched endpoint, owned by the ingest thread."""

    __slots__ = (
        "bad_seqs",
        "batches",
        "connected",
        "decode_errors",
        "last_lag",
        "last_seen",
        "mirror",
        "monitor",
        "replay",
        "seq",
        "sock",
        "spec",
    )

    def __init__(self, spec: StreamSpec, seq: StreamSequencer | None) -> None:
        self.spec = spec
        self.seq = seq  # None for probe ports
        self.sock: zmq.Socket[bytes] | None = None
        self.monitor: zmq.Socket[bytes] | None = None
        self.replay: tuple[int, zmq.Socket[bytes]] | None = None
        self.mirror: MirrorDetector | None = None
        self.connected = False
        self.decode_errors: dict[str, int] = {}
        self.bad_seqs: deque[int] = deque(maxlen=64)  # seqs that did not decode, live or replay
        self.batches = 0  # probe ports: KV batches seen
        self.last_seen = 0.0  # monotonic time of the last message
        self.last_lag: float | None = None


def count_bad(st: WatchedStream, reason: str, seq_frame: bytes) -> None:
    """Count one message that did not decode, once per seq whether live or replay saw it first.

    The replay ring returns the live bytes, so the same bad batch arrives on both paths.
    """
    if len(seq_frame) == 8:
        seq = int.from_bytes(seq_frame, "big")
        if seq in st.bad_seqs:
            return
        st.bad_seqs.append(seq)
    st.decode_errors[reason] = st.decode_errors.get(reason, 0) + 1


def stream_stats(st: WatchedStream, sq: StreamSequencer, now: float) -> StreamStats:
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
    return StreamStats(
        spec.worker_id,
        spec.dp_rank,
        engine=spec.engine,
        endpoint=spec.endpoint,
        topic=spec.topic,
        up=st.connected,
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
        duplicate_stream=sq.duplicate_stream(now),
        rank_mismatch_batches=sq.rank_mismatch_batches,
        decode_errors=dict(st.decode_errors),
        interleaved_batches=sq.interleaved_batches,
        already_resident=idx.store_of_resident_total,
        unknown_removed=idx.remove_of_unknown_total,
        state_complete=sq.state_complete,
        last_batch_ts=sq.last_ts or 0.0,
        lag_seconds=st.last_lag,
    )
