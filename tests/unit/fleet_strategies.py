"""Generated fleets (hypothesis strategies) for the property tests.

`fleets()`: what the condition pre-checks read (tests/unit/test_condition_prechecks.py): streams
with every StreamStats field drawn by type, workers, scheduler stats, drift, sources, binds.
"""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import strategies as st

from kvobserve.analysis.conditions import DOWN_AFTER_S, RECENT_S, THRASH_MIN_STORES, labels
from kvobserve.analysis.fleet import FleetState
from kvobserve.analysis.views import Key
from kvobserve.wire.misses import STORE, MissDelta, pack_op
from kvobserve.wire.snapshot import (
    BindStats,
    CollectorInfo,
    DriftStats,
    MediumStats,
    RelayStats,
    SchedulerStats,
    Snapshot,
    SourceState,
    StreamStats,
    UnexpectedStream,
    WorkerInfo,
)

NOW = 50_000.0
STATES = ("", "starting", "connecting", "waiting", "up", "idle", "duplicate", "not_publisher",
          "undecodable", "wrong_topic", "down")  # fmt: skip
Fleet = tuple[FleetState, dict[Key, float]]


def times() -> st.SearchStrategy[float]:
    """Never (0), the edges of the windows, anywhere in the last hour, a little ahead."""
    edges = [NOW, NOW - DOWN_AFTER_S, NOW - RECENT_S, NOW - RECENT_S - 0.001, NOW - 2 * RECENT_S]
    return st.one_of(
        st.just(0.0), st.sampled_from(edges), st.floats(NOW - 3600, NOW + 5, allow_nan=False)
    )


def _field(name: str, kind: Any) -> st.SearchStrategy[Any]:
    """Values of one StreamStats field, by its type (a field added later is drawn too): times
    around the windows' edges, counts small and past the thresholds, every state word."""
    if name == "media":
        medium = st.builds(
            MediumStats,
            st.sampled_from(["GPU", "DEVICE", "CPU_PINNED"]),
            stored_total=st.sampled_from([0, THRASH_MIN_STORES - 1, THRASH_MIN_STORES, 5000]),
            restored_total=st.integers(0, 3000),
        )
        return st.lists(medium, max_size=2)
    if kind is bool:
        return st.booleans()
    if kind is int:
        return st.one_of(st.integers(0, 3), st.sampled_from([1000, 5000]))
    if kind is str:
        return st.sampled_from([*STATES, "partial", "connection refused", "joined mid-stream"])
    if kind in (float, float | None):
        timed = name.endswith(("_time", "_since", "_ts"))
        value = times() if timed else st.floats(0.0, 60.0)
        return st.one_of(st.none(), value) if kind is not float else value
    if kind == dict[str, int]:
        return st.sampled_from([{}, {"msgpack": 2}, {"remove_unknown": 3}])
    return st.builds(list)  # lists of parts no condition reads (hot prefixes)


STREAM_FIELDS = {
    f.name: _field(f.name, f.type)
    for f in msgspec.structs.fields(StreamStats)
    if f.name not in ("worker_id", "dp_rank")
}


@st.composite
def one_field_off(draw: st.DrawFn, worker: str, rank: int, state: str = "up") -> StreamStats:
    """A connected stream (in `state`) with one more field drawn: then a pre-check is often the
    only one that lets the stream through."""
    connected = {
        "up": True,
        "state": state,
        "state_complete": True,
        "batches_total": 5,
        "state_since": draw(times()),
        "last_message_time": draw(times()),
    }
    name = draw(st.sampled_from(sorted(STREAM_FIELDS)))
    return StreamStats(worker, rank, **{**connected, name: draw(STREAM_FIELDS[name])})


@st.composite
def stream_stats(draw: st.DrawFn, worker: str, rank: int) -> StreamStats:
    """Every field at random, or one field off a connected stream."""
    if draw(st.booleans()):
        return StreamStats(worker, rank, **{k: draw(v) for k, v in STREAM_FIELDS.items()})
    return draw(one_field_off(worker, rank, draw(st.sampled_from(["up", "idle", "waiting"]))))


@st.composite
def fleets(draw: st.DrawFn) -> Fleet:
    """A FleetState of 1-3 collectors (live or silent) and when conditions began before."""
    state = FleetState()  # a collector is down 3 intervals (3 s) after its last snapshot
    began: dict[Key, float] = {}
    t = times()
    for c in range(draw(st.integers(1, 3))):
        received = NOW - draw(st.sampled_from([0.0, 0.5, 2.9, 3.1, 30.0]))
        snap = Snapshot(CollectorInfo(f"c{c}", c, f"h{c}", 1.0), seq=1, time=received)
        for w in ("w0", "w1")[: draw(st.integers(1, 2))]:
            size = draw(st.integers(1, 3))
            owned = sorted(draw(st.lists(st.integers(0, size - 1), unique=True, max_size=size)))
            snap.workers.append(
                WorkerInfo(
                    w, "sglang", size, owned, draw(st.booleans()),
                    state=draw(st.sampled_from(["", "watching", "undiscovered", "layout_mismatch"])),
                    reason="why", since=draw(t), elsewhere=draw(st.sampled_from([[], [2]])),
                )
            )  # fmt: skip
            for r in owned:
                snap.streams.append(draw(stream_stats(w, r)))
                if draw(st.booleans()):  # it was down at an earlier check
                    key = ("stream_down", labels(worker_id=w, node_rank=c, dp_rank=r))
                    began[key] = draw(t)
                if draw(st.booleans()):
                    snap.scheduler.append(
                        SchedulerStats(
                            w, r, "metrics",
                            running_requests=draw(st.sampled_from([None, 0.0, 2.0])),
                            token_usage_ratio=draw(st.sampled_from([None, 0.5, 0.96])),
                            updated=draw(st.sampled_from([0.0, received, received - 100])),
                        )
                    )  # fmt: skip
                if draw(st.booleans()):
                    snap.drift.append(
                        DriftStats(w, r, "GPU", phantom=draw(st.integers(0, 40)), engine_blocks=100,
                                   at=draw(t))
                    )  # fmt: skip
            if draw(st.booleans()):
                state_word = draw(st.sampled_from(["up", "down", "undecodable", "idle"]))
                snap.sources.append(
                    SourceState(w, "metrics", "http://h", state_word, "why", draw(t))
                )
            if draw(st.booleans()):
                snap.unexpected.append(
                    UnexpectedStream(w, size, "tcp://h:1", 5, draw(st.booleans()))
                )
            if draw(st.booleans()):  # bind mode, with a relay that may have dropped frames
                relay = RelayStats(
                    "ipc://@r", "up", dropped={"queue_full": 2}, last_drop_time=draw(t)
                )
                snap.binds.append(BindStats(w, 0, "tcp://*:5557", relay=relay))
        if c == 0 and draw(st.booleans()):  # a pool's sampled misses; placement or not
            snap.misses.append(pool_delta(draw(st.sampled_from([0, 300, 700])), received))
        state.update(snap, received)
    return state, began


def pool_delta(placement: int, until: float, worker: str = "wp", blocks: int = 4500) -> MissDelta:
    """Pool `p` (`worker`, by default one with no stream): rank 0 stores 4,500 sampled blocks,
    rank 1 then `placement` of the same ones (2 ranks: 7 and 13 % of the misses)."""
    ops = bytearray()
    keys = [(i * 0x9E3779B97F4A7C15) % (1 << 62) for i in range(1, blocks + 1)]  # buckets >= 2
    for k in keys:
        pack_op(ops, 0, 0, STORE, k)
    for k in keys[:placement]:
        pack_op(ops, 1, 1, STORE, k)
    return MissDelta("p", 1, 1, until - 1.0, until, [0, 1], bytes(ops), workers=[worker] * 2)
