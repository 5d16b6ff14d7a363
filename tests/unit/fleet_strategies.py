"""Generated fleets (hypothesis strategies) for the property tests of the conditions and exports.

`fleets()`: what the condition pre-checks read (tests/unit/test_condition_prechecks.py): streams
with every StreamStats field drawn by type, workers, scheduler stats, drift, sources, binds.
`snapshot_sets()`: what /metrics reads (tests/unit/test_export_writers.py): every scope's
variants besides (binds with and without a relay, pods, Dynamo planes, down and empty
collectors, split and partial snapshots, clashing streams, odd label text and values).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from hypothesis import strategies as st

from kvobserve.analysis.conditions import (
    DOWN_AFTER_S,
    PLACEMENT,
    PLACEMENT_MIN_S,
    RECENT_S,
    STREAM_DOWN,
    THRASH_MIN_STORES,
    labels,
)
from kvobserve.analysis.fleet import FleetState
from kvobserve.analysis.miss_fleet import MissMerge
from kvobserve.analysis.views import Key
from kvobserve.wire.misses import STORE, MissDelta, pack_op
from kvobserve.wire.parts import split_parts
from kvobserve.wire.snapshot import (
    BindStats,
    CheckpointStats,
    CollectorCounters,
    CollectorInfo,
    DriftSource,
    DriftStats,
    DynamoPlaneStats,
    DynamoStreamStats,
    Family,
    Histogram,
    MediumStats,
    PrefixCounters,
    RelayStats,
    Sample,
    SchedulerStats,
    Snapshot,
    SourceErrors,
    SourceState,
    StreamStats,
    UnexpectedStream,
    WorkerInfo,
    WorkerPlacement,
)
from tests.unit.test_export_fleet import _curve_pool  # the rich fleet's pool with a curve

NOW = 50_000.0
STATES = ("", "starting", "connecting", "waiting", "up", "idle", "duplicate", "not_publisher",
          "undecodable", "wrong_topic", "down")  # fmt: skip
Fleet = tuple[FleetState, dict[Key, float]]
T = TypeVar("T")


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
    state.misses = MissMerge(SAMPLE_FLOOR, SAMPLE_LEVEL)
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
                    key = (STREAM_DOWN, labels(worker_id=w, node_rank=c, dp_rank=r,
                                               collector=f"c{c}"))  # fmt: skip
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
        if draw(st.booleans()):  # checkpoints written, failing, off, or an older collector
            snap.checkpoint = draw(
                st.sampled_from([None, CheckpointStats(), CheckpointStats(state="off"),
                                 CheckpointStats("failing", "no_space", "/x: full", draw(t))])
            )  # fmt: skip
        if c == 0 and draw(st.booleans()):  # a pool's sampled misses; placement or not
            # its window opened long enough ago to judge, or not; active before, or not
            opened = received - draw(st.sampled_from([PLACEMENT_MIN_S + 60, 60.0]))
            first = Snapshot(snap.collector, seq=0, time=opened, misses=[_window(0, opened, 1)])
            state.update(first, opened)
            snap.misses.append(_window(draw(st.sampled_from(PLACED)), received, 2))
            if draw(st.booleans()):
                began[(PLACEMENT, labels(pool="p"))] = draw(t)
        state.update(snap, received)
    if draw(st.booleans()):  # an earlier view: ranks uncovered then have been so a while
        state.view(NOW - draw(st.sampled_from([1.0, DOWN_AFTER_S, 30.0])))
    return state, began


# The pool's split in `fleets` is sampled at level 4 (a sampled block weighs 16) with a floor of
# 400 sampled misses: rank 0 stores 700 sampled blocks (11,200 misses), rank 1 `placement` of the
# same ones again: 0, 3.4 % (between the placement condition's thresholds), 9.1 % of the misses.
SAMPLE_LEVEL, SAMPLE_FLOOR, SAMPLED, PLACED = 4, 400, 700, (0, 25, 70)


@functools.cache
def _window_ops(placement: int) -> bytes:
    ops = bytearray()
    blocks = [(i * 0x9E3779B97F4A7C15) % (1 << 60) for i in range(1, SAMPLED + 1)]  # buckets >= 4
    for k in blocks:
        pack_op(ops, 0, 0, STORE, k)
    for k in blocks[:placement]:
        pack_op(ops, 1, 1, STORE, k)
    return bytes(ops)


def _window(placement: int, until: float, seq: int) -> MissDelta:
    """Pool `p` (worker `wp`, no stream here) up to `until`; seq 1 opens its window (no op)."""
    ops = _window_ops(placement) if seq > 1 else b""
    return MissDelta("p", seq, SAMPLE_LEVEL, until - 1.0, until, [0, 1], ops, workers=["wp", "wp"])


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


# --- what /metrics reads: every scope's variants ---------------------------------------------

# Label text as engines and configs may give it: the text format's escapes, the templates' own
# marker (%), braces, non-ASCII, a NUL.
_ODD = st.text(alphabet='ab:/"\\\n%{}é\x00 ', max_size=5)
# Counts past the fast paths of the text writer; gauges' values besides: negative, not finite.
# (A counter is never negative or NaN: OpenMetrics' parser would refuse the exposition.)
_NUMBERS = st.sampled_from([0, 1, 7, 999_999, 1_000_000, 123_456_789, 2**53 + 1])
_SUMS = st.sampled_from([0.0, 0.5, 42.25, 1e6, 12345678.9, 1e16, 1e300, float("inf")])
_FLOATS = st.one_of(
    st.floats(-1e3, 1e3),
    st.sampled_from([0.5, 1e6, 12345678.9, 1e16, 1e300, float("inf"), float("nan"), -0.0]),
)
_MAYBE_FLOAT = st.none() | _FLOATS
_BOOL = st.booleans()
MODES = ("connect", "bind", "bind_relay", "pods", "dynamo")  # how a worker's streams are reached
_MEDIA = ("GPU", "CPU_PINNED", "DISK")


@functools.cache
def _int(lo: int, hi: int) -> st.SearchStrategy[int]:
    """st.integers, made once per range (a strategy made per draw is validated per draw)."""
    return st.integers(lo, hi)


def _pick(draw: st.DrawFn, options: Sequence[T]) -> T:
    """One of `options` (shrinking to the first)."""
    return options[draw(_int(0, len(options) - 1))]


def _some(draw: st.DrawFn, options: Sequence[T], most: int) -> list[T]:
    """At most `most` of `options`, in their order."""
    return [o for o in options if draw(_BOOL)][:most]


@st.composite
def _histogram(draw: st.DrawFn) -> Histogram:
    """Bounds ascending; counts per bucket (as a collector sends them), sometimes fewer."""
    bounds = _some(draw, [0.1, 1.0, 2.5, 60.0], 3)
    counts = [draw(_int(0, 9)) for _ in bounds]
    count = draw(_int(0, 30))
    return Histogram(bounds, counts[: draw(_int(0, len(counts)))], count, draw(_SUMS))


_MAYBE_HISTOGRAM = st.none() | _histogram()


@st.composite
def _medium(draw: st.DrawFn, name: str) -> MediumStats:
    """A storage tier with the cache analytics' parts drawn too (moves, unread blocks, LoRA)."""
    return MediumStats(
        name,
        blocks=draw(_NUMBERS),
        tokens=draw(_NUMBERS),
        stored_total=draw(_NUMBERS),
        removed_total=draw(_int(0, 9)),
        lifetime=draw(_MAYBE_HISTOGRAM),
        restored_total=draw(_int(0, 3)),
        restore_gap=draw(_MAYBE_HISTOGRAM),
        moved_in=_pick(draw, [{}, {"GPU": 3}, {"GPU": 1, "CPU_PINNED": 2}]),
        unread_removed_total=_pick(draw, [0, 4]),
        unread_blocks=_pick(draw, [0, 2]),
        lora_blocks=_pick(draw, [{}, {"sql": 3}, {"_other": 1, "a": 2}]),
    )


@st.composite
def _export_stream(draw: st.DrawFn, worker: str, rank: int) -> StreamStats:
    """A stream as fleets() draws it, with the parts /metrics reads drawn wider: tiers,
    dict-valued counters (replay results, decode errors, silent loss), odd text and values."""
    s = draw(stream_stats(worker, rank))
    media = _some(draw, _MEDIA, 2)
    return msgspec.structs.replace(
        s,
        engine=_pick(draw, ["sglang", "vllm", "dynamo", ""]),
        endpoint=draw(_ODD),
        topic=draw(_ODD),
        media=[draw(_medium(m)) for m in media],
        events=_pick(draw, [{}, {"stored": 3}, {"other_group": 1, "stored": 2}]),
        replay_requests=_pick(draw, [{}, {"ok": 1}, {"timeout": 2, "ok": 5}]),
        decode_errors=_pick(draw, [{}, {"msgpack": 2}, {"z": 1, "a": 2}]),
        silent_loss=_pick(draw, [{}, {"remove_unknown": 3}]),
        trust=_pick(draw, ["", "complete", "replay_filled", "partial"]),
        lag_seconds=draw(_MAYBE_FLOAT),
        batches_total=draw(_NUMBERS),
    )


@dataclass
class SnapshotSet:
    """Collectors' snapshots as an aggregator received them, and when /metrics is read."""

    snapshots: list[tuple[Snapshot, float]]  # (snapshot, received), in arrival order
    now: float

    def state(self) -> FleetState:
        """A FleetState that received them."""
        state = FleetState()
        for snap, received in self.snapshots:
            state.update(snap, received)
        return state


def _worker(draw: st.DrawFn, snap: Snapshot, w: str, mode: str, received: float) -> None:
    """Worker `w` in `mode` (how its streams are reached), into `snap`."""
    size = draw(_int(1, 3))
    owned = _some(draw, range(size), size)
    snap.workers.append(
        WorkerInfo(
            w, "dynamo" if mode == "dynamo" else "vllm", size, owned, draw(_BOOL),
            capacity_tokens=_pick(draw, [0, 4096]),
            state=_pick(draw, ["", "watching", "undiscovered", "layout_mismatch"]),
            reason=draw(_ODD), since=received,
        )
    )  # fmt: skip
    if mode == "pods":  # llm-d: each pod's stream is `{worker}/{pod}`, rank 0, on a bound port
        pods = _some(draw, ["p-a", "p-b", 'p"c'], 3)
        snap.streams.extend(draw(_export_stream(f"{w}/{p}", 0)) for p in pods)
        relay = RelayStats(draw(_ODD), _pick(draw, ["up", "waiting"])) if draw(_BOOL) else None
        snap.binds.append(
            BindStats(w, 0, "tcp://*:5556", "kv@{pod}@{model}", "connected", publishers=len(pods),
                      messages_total=draw(_NUMBERS), streams=len(pods), relay=relay)
        )  # fmt: skip
    elif mode == "dynamo":  # the event plane's streams are `{worker}/{dynamo worker id}`
        ids = _some(draw, [7, 8, 123456789], 2)
        for i in ids:
            for r in owned:
                snap.streams.append(draw(_export_stream(f"{w}/{i}", r)))
                snap.dynamo.append(DynamoStreamStats(f"{w}/{i}", r, i, envelope_gaps=1))
        snap.dynamo_planes.append(
            DynamoPlaneStats(w, _pick(draw, ["nats", "zmq"]), "nats://h:4222",
                             draw(_BOOL), errors=_pick(draw, [{}, {"x": 1}]))
        )  # fmt: skip
        if draw(_BOOL):  # a router's index compared with the plane's streams
            snap.drift_sources.append(
                DriftSource(w, "http://router", comparisons={"ok": 3, "http": 1},
                            last_ok=_pick(draw, [0.0, received]))
            )  # fmt: skip
            for i in ids:
                for r in owned:
                    medium, method = _pick(draw, _MEDIA), _pick(draw, ["dump", "size"])
                    snap.drift.append(
                        DriftStats(f"{w}/{i}", r, medium, method, phantom=draw(_NUMBERS),
                                   jaccard=draw(_MAYBE_FLOAT))
                    )  # fmt: skip
    else:
        for r in owned:
            snap.streams.append(draw(_export_stream(w, r)))
            if mode in ("bind", "bind_relay"):  # one endpoint per rank; a relay or none
                relay = None
                if mode == "bind_relay":
                    relay = RelayStats(
                        draw(_ODD), _pick(draw, ["up", "connecting", ""]),
                        forwarded=draw(_NUMBERS),
                        dropped=_pick(draw, [{}, {"no_target": 2}, {"other": 1}]),
                    )  # fmt: skip
                snap.binds.append(
                    BindStats(w, r, draw(_ODD), publishers=draw(_int(0, 2)),
                              skipped=_pick(draw, [{}, {"topic_mismatch": 4}]),
                              relay=relay)
                )  # fmt: skip
    for r in owned:
        if draw(_BOOL):
            snap.scheduler.append(
                SchedulerStats(
                    w, r, _pick(draw, ["metrics", "load+metrics", "kv_metrics"]),
                    running_requests=draw(_MAYBE_FLOAT),
                    queued_requests=_pick(draw, [None, 0.0, 3.0]),
                    token_usage_ratio=_pick(draw, [None, 0.5]),
                    cache_hit_ratio=_pick(draw, [None, 0.25]),
                    max_total_tokens=_pick(draw, [None, 0.0, 4096.0]),
                    updated=_pick(draw, [0.0, received, received - 100]),
                )
            )  # fmt: skip
    if draw(_BOOL):
        snap.sources.append(SourceState(w, "metrics", draw(_ODD), _pick(draw, ["down", "up", ""])))
        snap.scheduler_errors.append(SourceErrors(w, "fpm", draw(_ODD), draw(_NUMBERS)))
    if draw(_BOOL):
        snap.unexpected.append(UnexpectedStream(w, size, draw(_ODD), 5, draw(_BOOL)))
    if draw(_BOOL):
        distinct = draw(_int(0, 9))
        snap.placement.append(
            WorkerPlacement(w, owned, distinct * 2, distinct,
                            replicated=_pick(draw, [{}, {2: 3}, {2: 1, 9: 2}]),
                            recomputed_elsewhere=draw(_NUMBERS))
        )  # fmt: skip
        snap.prefix.append(PrefixCounters(w, -1, 40.0, 100.0))


@st.composite
def _collector(draw: st.DrawFn, c: int) -> list[tuple[Snapshot, float]]:
    """Collector `c`'s snapshots as received: one whole, split by worker bucket (the later
    parts may be lost: a partial view), or one with nothing but its identity."""
    received = NOW - _pick(draw, [0.0, 0.5, 3.1, 30.0])  # down after 3 s
    node = _pick(draw, [c, 0])  # node 0 twice: two collectors claim a stream
    info = CollectorInfo(f"c{c}", node, draw(_ODD), _pick(draw, [0.0, NOW - 60]))
    snap = Snapshot(info, seq=1, time=received)
    shape = _pick(draw, ["whole", "whole", "split", "empty"])
    if shape == "empty":
        return [(snap, received)]
    if draw(_BOOL):  # none from an older collector
        snap.counters = CollectorCounters(
            draw(_NUMBERS), draw(_int(0, 2)), publish_dropped=_pick(draw, [{}, {"buffer_full": 2}])
        )
    snap.refused = _pick(draw, [{}, {"streams": 2}])
    # checkpoints written, failing, off, or none (an older collector)
    snap.checkpoint = _pick(
        draw,
        [
            None,
            CheckpointStats(),
            CheckpointStats(state="off"),
            CheckpointStats("failing", "no_space", "/x: full", NOW - 9),
        ],
    )
    if draw(_BOOL):
        running = "sglang:num_running_reqs"
        snap.passthrough = [Family(running, "gauge", "Running.", [Sample(running, {"dp": "0"}, 2)])]
    workers = _some(draw, ["w0", "w1", "w2"], 2) or ["w0"]
    for w in workers:
        _worker(draw, snap, w, _pick(draw, MODES), received)
    if draw(_BOOL) and snap.streams:  # a collector repeating one of its streams
        snap.streams.append(snap.streams[0])
    if c == 0 and draw(_BOOL):
        placement = _pick(draw, [0, 30])  # few samples: the split is not trusted
        snap.misses.append(pool_delta(placement, received, workers[0], blocks=300))
    if shape == "whole":
        return [(snap, received)]
    parts = split_parts(snap)  # one part per worker bucket, as for sharded aggregators
    return [(p, received) for p in parts[: draw(_int(1, len(parts)))]]  # some lost


@st.composite
def snapshot_sets(draw: st.DrawFn) -> SnapshotSet:
    """1-3 collectors' snapshots (every scope's variants) and a time to read the fleet at."""
    out: list[tuple[Snapshot, float]] = []
    for c in range(draw(_int(1, 3))):
        out.extend(draw(_collector(c)))
    if draw(_BOOL):  # a pool with a trusted capacity curve: its baseline, then its evictions
        out.extend(_curve_collector())
    return SnapshotSet(out, NOW + _pick(draw, [0.0, 0.5]))


def _curve_collector() -> list[tuple[Snapshot, float]]:
    """A collector whose one pool has a trusted capacity curve (tests/unit/test_export_fleet.py's
    `vllm-d`): its first snapshot the curve's baseline, the second 4,200 blocks later."""
    out = []
    for seq, (early, at) in enumerate(((True, NOW - 5), (False, NOW - 0.2)), 1):
        part = _curve_pool(early)
        snap = Snapshot(CollectorInfo("cv", 9, "hv", 1.0), seq=seq, time=at, workers=part["workers"],
                        streams=part["streams"], misses=part["misses"], prefix=part["prefix"],
                        curves=part["curves"])  # fmt: skip
        out.append((snap, at))
    return out
