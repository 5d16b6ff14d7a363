"""Each stream condition's pre-check holds wherever its check finds it, over generated fleets.

The per-second check (`FleetState.conditions`) looks only at the streams some row's pre-check
lets through; the API and the page (`active(view)`) look at every stream. A pre-check that
missed a case would leave a condition on the page that never fires as a transition or event.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st

from kvobserve.analysis.conditions import (
    DOWN_AFTER_S,
    KINDS,
    RECENT_S,
    THRASH_MIN_STORES,
    Around,
    Condition,
    active,
    labels,
    may_have_condition,
)
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
from tests.examples import examples

NOW = 50_000.0
STATES = ("", "starting", "connecting", "waiting", "up", "idle", "duplicate", "not_publisher",
          "undecodable", "wrong_topic", "down")  # fmt: skip
STREAM_KINDS = [k.kind for k in KINDS.values() if k.per_stream]
Fleet = tuple[FleetState, dict[Key, float]]


def _times() -> st.SearchStrategy[float]:
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
        value = _times() if timed else st.floats(0.0, 60.0)
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
def _one_field_off(draw: st.DrawFn, worker: str, rank: int, state: str = "up") -> StreamStats:
    """A connected stream (in `state`) with one more field drawn: then a pre-check is often the
    only one that lets the stream through."""
    connected = {
        "up": True,
        "state": state,
        "state_complete": True,
        "batches_total": 5,
        "state_since": draw(_times()),
        "last_message_time": draw(_times()),
    }
    name = draw(st.sampled_from(sorted(STREAM_FIELDS)))
    return StreamStats(worker, rank, **{**connected, name: draw(STREAM_FIELDS[name])})


@st.composite
def _stream(draw: st.DrawFn, worker: str, rank: int) -> StreamStats:
    """Every field at random, or one field off a connected stream."""
    if draw(st.booleans()):
        return StreamStats(worker, rank, **{k: draw(v) for k, v in STREAM_FIELDS.items()})
    return draw(_one_field_off(worker, rank, draw(st.sampled_from(["up", "idle", "waiting"]))))


@st.composite
def fleets(draw: st.DrawFn) -> Fleet:
    """A FleetState of 1-3 collectors (live or silent) and when conditions began before."""
    state = FleetState()  # a collector is down 3 intervals (3 s) after its last snapshot
    began: dict[Key, float] = {}
    t = _times()
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
                snap.streams.append(draw(_stream(w, r)))
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
            snap.misses.append(_pool_delta(draw(st.sampled_from([0, 300, 700])), received))
        state.update(snap, received)
    return state, began


def _pool_delta(placement: int, until: float) -> MissDelta:
    """Pool `p` (worker `wp`, no stream here): rank 0 stores 4,500 sampled blocks, rank 1 then
    `placement` of the same ones (2 ranks: 7 and 13 % of the misses)."""
    ops = bytearray()
    blocks = [(i * 0x9E3779B97F4A7C15) % (1 << 62) for i in range(1, 4501)]  # buckets >= 2
    for k in blocks:
        pack_op(ops, 0, 0, STORE, k)
    for k in blocks[:placement]:
        pack_op(ops, 1, 1, STORE, k)
    return MissDelta("p", 1, 1, until - 1.0, until, [0, 1], bytes(ops), workers=["wp", "wp"])


def _whole(fleet: Fleet) -> list[Condition]:
    state, began = fleet
    v = state.view(NOW)
    v.began = began
    return active(v)


@settings(max_examples=examples(400), deadline=None)
@given(fleets())
def test_every_rows_precheck_holds_where_its_check_finds_the_condition(fleet: Fleet) -> None:
    state, began = fleet
    v = state.view(NOW)
    v.began = began
    at = Around(v)
    for s in v.streams:
        for kind in STREAM_KINDS:
            k = KINDS[kind]
            if k.find(s, at) is not None:
                assert k.may(s.stats, s.live, NOW), (kind, s.live, s.stats)


@settings(max_examples=examples(400), deadline=None)
@given(fleets())
def test_the_per_second_check_finds_what_the_whole_view_shows(fleet: Fleet) -> None:
    """The same conditions, in the same order, each since the same time."""
    state, began = fleet
    whole = _whole(fleet)
    fast = state.conditions(NOW, began)
    assert [(c, c.since) for c in fast] == [(c, c.since) for c in whole]


@settings(max_examples=examples(1500), deadline=None)
@given(_one_field_off("w", 0), st.booleans())
def test_the_per_second_filter_is_the_rows_prechecks(stats: StreamStats, live: bool) -> None:
    """`may_have_condition` reads the event kinds' times at once: the same as asking each row."""
    rows = any(k.may(stats, live, NOW) for k in KINDS.values() if k.per_stream)
    assert may_have_condition(stats, live, NOW) == rows


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_generated_fleets_reach_every_condition(kind: str) -> None:
    """The properties above are not vacuous: each row's condition occurs in generated fleets."""

    def has(fleet: Fleet) -> bool:
        return any(c.kind == kind for c in _whole(fleet))

    once = settings(
        max_examples=3000, phases=[Phase.generate], derandomize=True, database=None, deadline=None
    )
    found: Any = find(fleets(), has, settings=once)  # the first one: no shrinking
    assert has(found)


def test_a_stream_condition_has_a_precheck_and_the_others_none() -> None:
    """A row is found per stream (an event's time and description, or a check and its
    pre-check) or over the membership (none of them)."""
    for k in KINDS.values():
        assert (k.check is None) == (k.precheck is None), k.kind
        assert bool(k.event_time) == (k.describe is not None), k.kind
        assert not (k.event_time and k.check), k.kind
    assert {"stream_down", "sequence_gap", "cache_thrash", "stream_stalled"} <= set(STREAM_KINDS)
    assert not {"collector_down", "dp_rank_uncovered", "cache_near_full"} & set(STREAM_KINDS)
