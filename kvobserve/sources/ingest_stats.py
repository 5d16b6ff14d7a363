"""What a collector's stream core reports in each snapshot: its streams, endpoints, pods and caps.

Built from a `StreamTable` (sources/stream_table.py) in the thread that owns it, so the picture is
consistent: every stream's `StreamStats` (sources/stream_state.py) with its cache analytics
(sources/cache_stats.py), the probe ports that carry events, the bound endpoints and the pods
their topics named, the placement of each worker's blocks and the miss split's deltas.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.sources import cache_stats
from kvobserve.sources.miss_stats import UNTIL_SLACK_S
from kvobserve.sources.stream_state import stream_stats
from kvobserve.sources.stream_table import StreamTable
from kvobserve.wire.capacity import RankCurveStats
from kvobserve.wire.misses import MissDelta
from kvobserve.wire.snapshot import (
    BindStats,
    CheckpointStats,
    StreamStats,
    UnexpectedStream,
    WorkerPlacement,
)


@dataclass(frozen=True)
class IngestStats:
    """What the ingest thread reports for one snapshot."""

    streams: list[StreamStats]
    unexpected: list[UnexpectedStream]
    refused: dict[str, int]  # what a cardinality cap refused: streams, medium_events
    messages_received: int = 0
    loop_errors: int = 0
    placement: list[WorkerPlacement] = field(default_factory=list)
    binds: list[BindStats] = field(default_factory=list)  # bind mode: the endpoints bound
    pods: dict[str, list[str]] = field(default_factory=dict)  # [[worker]] id -> its pods' ids
    misses: list[MissDelta] = field(default_factory=list)  # the miss split's, one per pool
    checkpoint: CheckpointStats | None = None  # the checkpoints' state (None: off)
    curves: list[RankCurveStats] = field(default_factory=list)  # every curve interval


def build_stats(
    table: StreamTable,
    now: float,
    wall: float,
    whole: frozenset[str] = frozenset(),
    loop_errors: int = 0,
    checkpoint: CheckpointStats | None = None,
    capacities: Mapping[tuple[str, int], tuple[float, float]] | None = None,
) -> IngestStats:
    """The table as one snapshot sees it (`now` monotonic, `wall` the same instant); `whole`:
    workers whose every rank this collector watches (their placement needs no sketch);
    `capacities`: the engines' KV capacity in tokens by stream, and when it was read (wall)."""
    siblings: dict[str, list[StreamSequencer]] = {}
    for (worker_id, _), w in table.streams.items():
        if w.seq is not None:
            siblings.setdefault(worker_id, []).append(w.seq)
    streams: list[StreamStats] = []
    unexpected: list[UnexpectedStream] = []
    refused = {"streams": table.refused_streams_total, "medium_events": 0}
    quiet_s = table.options.unexpected_quiet_s
    for st in table.streams.values():
        spec = st.spec
        if st.seq is None:
            active = st.batches > 0 and now - st.last_seen < quiet_s
            unexpected.append(
                UnexpectedStream(spec.worker_id, spec.dp_rank, spec.endpoint, st.batches, active)
            )
            continue
        if st.link is not None:
            st.link.observe_duplicate(st.seq.duplicate_stream(now), wall)
        if st.history is not None:
            st.history.update(st.seq, st.decode_errors, now, wall)
        if capacities is not None:
            st.capacity = capacities.get(spec.key)
        s = stream_stats(st, st.seq, now, wall)
        cache_stats.fill_stream(s, st.seq, [q.index for q in siblings[spec.worker_id]], wall)
        if st.link is not None:
            link = st.link
            s.trust_reason = st.seq.trust_reason(now, link.last_data, link.zmq_at is not None)
        streams.append(s)
        refused["medium_events"] += st.seq.index.media_refused_events
    pods: dict[str, list[str]] = {}
    for key, lst in table.pods.items():  # every rank of a pod comes to this collector
        pods.setdefault(lst.spec.worker_id, []).append(key[0])
    whole = whole | {w for ws in pods.values() for w in ws}
    placement: list[WorkerPlacement] = []
    if table.placements is not None:
        placement = table.placements.build(
            (
                (w.spec.worker_id, w.spec.dp_rank, w.spec.engine, w.seq)
                for w in table.streams.values()
                if w.seq is not None
            ),
            whole,
            now,
        )
    misses = table.misses.deltas(wall - UNTIL_SLACK_S) if table.misses is not None else []
    return IngestStats(
        streams,
        unexpected,
        {k: v for k, v in refused.items() if v},
        table.received_total,
        loop_errors,
        placement,
        [lst.stats() for lst in table.listeners.values()],
        {w: sorted(set(ids)) for w, ids in pods.items()},
        misses,
        checkpoint,
        table.curves.stats(now) if table.curves is not None else [],
    )
