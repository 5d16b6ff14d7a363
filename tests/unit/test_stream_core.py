"""Every guarantee at the sockets, in every receiving mode, on the stream core without sockets.

The core (sources/stream_table.py) is driven by tests/unit/core_harness.py: engines that put each
version's bytes on the wire (the simulator's encoders, held to the real engines' captures) and a
fake clock. `TABLE` is the matrix: for each guarantee, each mode either runs it or says why it
does not apply there; a test holds the table complete. Dynamo's planes have their own core
(sources/dynamo_streams.py) and their cells in tests/unit/test_dynamo_core.py.
"""

from __future__ import annotations

import pytest

from kvobserve.analysis.conditions import DOWN_AFTER_S
from kvobserve.sources.ingest_options import IngestOptions
from tests.unit.core_harness import MODES, Engine, Harness, Mode, engine_for

POD_SILENT = "a pod is known from its first message on: one that never sent is not a stream yet"
ONE_PUBLISHER_PER_SOCKET = (
    "each stream is its own SUB to one publisher's endpoint: a second publisher cannot share it"
)

# guarantee -> mode -> None (runs) or why it does not apply in that mode
TABLE: dict[str, dict[str, str | None]] = {
    "gaps_recovered_by_replay": dict.fromkeys(MODES),
    "a_partial_reply_loses_what_the_ring_no_longer_holds": dict.fromkeys(MODES),
    "several_gaps_filled_by_one_reply": dict.fromkeys(MODES),
    "a_restarted_publisher_resets_the_index": dict.fromkeys(MODES),
    "two_publishers_on_one_stream_are_a_duplicate_stream": {
        "connect": None,
        "bind": None,
        "template": None,
        "relay": None,
        "pods": ONE_PUBLISHER_PER_SOCKET,
    },
    "a_tail_lost_before_the_publisher_idles_is_recovered": dict.fromkeys(MODES),
    "joining_mid_stream_replays_from_seq_0": dict.fromkeys(MODES),
    "joining_an_idle_publisher_asks_its_ring": {
        "connect": None,
        "bind": None,
        "pods": None,
        "template": POD_SILENT,
        "relay": POD_SILENT,
    },
    "a_dead_publisher_goes_down_and_its_gauges_leave": dict.fromkeys(MODES),
    "a_reconnect_of_the_same_publisher_recovers_what_it_missed": dict.fromkeys(MODES),
    "streams_past_max_streams_are_refused_and_counted": dict.fromkeys(MODES),
    "metrics_render_in_every_mode": dict.fromkeys(MODES),
    "a_restarted_collector_resumes_from_its_checkpoint": dict.fromkeys(MODES),
}


def cells(guarantee: str) -> list[str]:
    """The modes a guarantee runs in."""
    return [m for m, why in TABLE[guarantee].items() if why is None]


def test_the_table_names_every_mode_for_every_guarantee() -> None:
    tests = {n.removeprefix("test_") for n in globals() if n.startswith("test_")}
    assert set(TABLE) <= tests, set(TABLE) - tests
    for g, row in TABLE.items():
        assert set(row) == set(MODES), g
        assert all(why is None or len(why) > 20 for why in row.values()), g


def _setup(mode: str, *, n: int = 1, options: IngestOptions | None = None,
           checkpoints: bool = False, **engine: object) -> tuple[Harness, Mode, list[Engine]]:  # fmt: skip
    h = Harness(options or IngestOptions(), checkpoints={} if checkpoints else None)
    m = MODES[mode](h)
    # n ranks of one worker, or n pods (of rank 0) where streams are pods
    engines = [engine_for(m, rank=0 if m.pods else i, pod=f"p{i}", **engine)  # type: ignore[arg-type]
               for i in range(n)]  # fmt: skip
    m.plan(*engines)
    for e in engines:
        m.connect(e)
    return h, m, engines


def _send(h: Harness, m: Mode, e: Engine, n: int, skip: tuple[int, ...] = ()) -> None:
    """`n` batches published, those whose seq is in `skip` lost on the way."""
    for _ in range(n):
        frames = e.batch(h.wall)
        if e.seq - 1 not in skip:
            m.deliver(e, frames)
        h.advance(0.01)


# --- the guarantees -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", cells("gaps_recovered_by_replay"))
@pytest.mark.parametrize("fmt", ["vllm-0.33", "sglang-0.5.23", "vllm-0.10"])
def test_gaps_recovered_by_replay(mode: str, fmt: str) -> None:
    h, m, (e,) = _setup(mode, fmt=fmt)
    _send(h, m, e, 10, skip=(3, 6))
    s = h.stream_stats(*m.key(e))
    assert (s.gaps, s.missed, s.recovered, s.lost) == (2, 2, 2, 0)
    assert s.replay_requests == {"ok": 2}
    assert (s.trust, s.trust_reason) == ("replay_filled", "gap_replayed")
    assert h.resident(*m.key(e)) == e.truth
    assert s.up and s.state == "up"


@pytest.mark.parametrize("mode", cells("a_partial_reply_loses_what_the_ring_no_longer_holds"))
def test_a_partial_reply_loses_what_the_ring_no_longer_holds(mode: str) -> None:
    h, m, (e,) = _setup(mode, ring=4)
    h.auto_replay = False
    _send(h, m, e, 3)
    _send(h, m, e, 6, skip=tuple(range(3, 9)))  # 3..8 lost live
    _send(h, m, e, 1)  # 9: the gap is seen; the ring holds 6..9 by now
    h.pump()
    s = h.stream_stats(*m.key(e))
    assert (s.gaps, s.missed, s.recovered, s.lost) == (1, 6, 3, 3)
    assert s.replay_requests == {"partial": 1}
    assert (s.trust, s.trust_reason) == ("partial", "lost_batches")
    assert not s.state_complete


@pytest.mark.parametrize("mode", cells("several_gaps_filled_by_one_reply"))
def test_several_gaps_filled_by_one_reply(mode: str) -> None:
    h, m, (e,) = _setup(mode)
    h.auto_replay = False
    _send(h, m, e, 8, skip=(3, 4, 6))
    assert [start for _, start in h.answered] == []
    h.pump()  # one reply, from seq 3 on, carries both holes
    assert [start for _, start in h.answered] == [3]
    s = h.stream_stats(*m.key(e))
    assert (s.gaps, s.missed, s.recovered, s.lost) == (2, 3, 3, 0)
    assert s.replay_requests == {"ok": 1}
    assert h.resident(*m.key(e)) == e.truth


@pytest.mark.parametrize("mode", cells("a_restarted_publisher_resets_the_index"))
def test_a_restarted_publisher_resets_the_index(mode: str) -> None:
    h, m, (e,) = _setup(mode)
    _send(h, m, e, 5)
    m.disconnect(e)
    e.restart()
    m.connect(e)
    _send(h, m, e, 4)
    s = h.stream_stats(*m.key(e))
    assert (s.restarts, s.gaps, s.lost) == (1, 0, 0)
    assert (s.trust, s.trust_reason) == ("complete", "from_start")
    assert h.resident(*m.key(e)) == e.truth
    assert s.up


@pytest.mark.parametrize("mode", cells("two_publishers_on_one_stream_are_a_duplicate_stream"))
def test_two_publishers_on_one_stream_are_a_duplicate_stream(mode: str) -> None:
    h, m, (a,) = _setup(mode)
    b = Engine(a.fmt.name, a.rank, topic=a.topic, pod=a.pod)  # the same rank (and pod) again
    if mode == "connect":  # both behind one endpoint: what the SUB reads interleaves
        m.specs[b] = m.specs[a]
        m.stream = lambda e: h.table.streams[m.key(a)]  # type: ignore[method-assign]
    else:
        m.connect(b)
    for _ in range(6):
        m.deliver(a, a.batch(h.wall))
        m.deliver(b, b.batch(h.wall))
        h.advance(0.1)
    s = h.stream_stats(*m.key(a))
    assert s.duplicate_stream and s.state == "duplicate"
    assert (s.trust, s.trust_reason) == ("partial", "second_publisher")
    assert s.interleaved_batches >= 4
    assert ("duplicate_stream", "{}#{}".format(*m.key(a))) in h.conditions(m.workers())


@pytest.mark.parametrize("mode", cells("a_tail_lost_before_the_publisher_idles_is_recovered"))
def test_a_tail_lost_before_the_publisher_idles_is_recovered(mode: str) -> None:
    h, m, (e,) = _setup(mode)
    _send(h, m, e, 6, skip=(5,))  # the burst's last batch is lost; then the engine idles
    assert h.resident(*m.key(e)) != e.truth
    h.advance(3.0)  # the first tail check: 2 s after the last batch
    s = h.stream_stats(*m.key(e))
    assert (s.gaps, s.missed, s.recovered, s.lost) == (1, 1, 1, 0)
    assert h.resident(*m.key(e)) == e.truth
    assert s.trust_reason in ("gap_replayed", "from_start")


@pytest.mark.parametrize("mode", cells("joining_mid_stream_replays_from_seq_0"))
@pytest.mark.parametrize("ring", [10_000, 3])
def test_joining_mid_stream_replays_from_seq_0(mode: str, ring: int) -> None:
    h, m, (e,) = _setup(mode, ring=ring, keep=100)
    for _ in range(5):  # published before the collector was there
        e.batch(h.wall)
    _send(h, m, e, 3)
    s = h.stream_stats(*m.key(e))
    assert s.missed == 0 and s.lost == 0  # before the join is not missed
    if ring > 8:
        assert (s.trust, s.trust_reason) == ("complete", "replayed_from_start")
        assert h.resident(*m.key(e)) == e.truth
    else:  # the ring no longer reaches seq 0: a lower bound, said so
        assert (s.trust, s.trust_reason) == ("partial", "joined_midstream")
        assert h.resident(*m.key(e)) < e.truth  # what it holds is the engine's, not all of it


@pytest.mark.parametrize("mode", cells("joining_an_idle_publisher_asks_its_ring"))
@pytest.mark.parametrize("ring", [10_000, 3])
def test_joining_an_idle_publisher_asks_its_ring(mode: str, ring: int) -> None:
    # seen: the real vLLM 0.26 publisher idle when the SUB reached it: 0 blocks shown against
    # 143 held for the rest of the run
    h = Harness()
    m = MODES[mode](h)
    e = engine_for(m, ring=ring)
    for _ in range(8):  # published and gone idle before the collector started
        e.batch(h.wall)
    m.plan(e)
    m.connect(e)
    h.advance(1.0)
    s = h.stream_stats(*m.key(e))
    assert s.blocks if hasattr(s, "blocks") else True
    assert (s.trust, s.trust_reason) == ("partial", "waiting")
    h.advance(2.0)  # the tail checks' schedule: 2 s after connecting
    assert [start for _, start in h.answered] == [0]
    s = h.stream_stats(*m.key(e))
    if ring > 8:
        assert h.resident(*m.key(e)) == e.truth
        assert (s.trust, s.trust_reason) == ("complete", "replayed_from_start")
    else:
        assert (s.trust, s.trust_reason) == ("partial", "joined_midstream")
    assert (s.gaps, s.missed, s.lost) == (0, 0, 0)
    _send(h, m, e, 2)  # and it goes on from there
    assert h.stream_stats(*m.key(e)).gaps == 0
    if ring > 8:
        assert h.resident(*m.key(e)) == e.truth


def test_an_idle_publisher_that_never_published_is_complete_and_empty() -> None:
    h, m, (e,) = _setup("connect")
    h.advance(3.0)
    s = h.stream_stats(*m.key(e))
    assert (s.trust, s.trust_reason) == ("complete", "replayed_from_start")
    assert h.resident(*m.key(e)) == set()
    _send(h, m, e, 2)
    assert h.resident(*m.key(e)) == e.truth
    assert h.stream_stats(*m.key(e)).gaps == 0


def test_an_idle_join_without_a_replay_endpoint_asks_nothing() -> None:
    h, m, (e,) = _setup("connect", replay=False)
    h.advance(10.0)
    assert h.answered == [] and not any(type(a).__name__ == "Replay" for a in h.actions)
    assert h.stream_stats(*m.key(e)).trust_reason == "waiting"


@pytest.mark.parametrize("mode", cells("a_dead_publisher_goes_down_and_its_gauges_leave"))
def test_a_dead_publisher_goes_down_and_its_gauges_leave(mode: str) -> None:
    h, m, (a, b) = _setup(mode, n=2)
    for _ in range(3):
        _send(h, m, a, 1)
        _send(h, m, b, 1)
    ka, kb = (f"{k[0]}#{k[1]}" for k in (m.key(a), m.key(b)))
    served = h.metrics(m.workers())
    assert served[("kvobserve_kv_blocks", ka)] == len(a.truth)
    a.alive = False
    m.disconnect(a)
    sa, sb = h.stream_stats(*m.key(a)), h.stream_stats(*m.key(b))
    assert (sa.up, sb.up) == (False, True)
    served = h.metrics(m.workers())
    assert served[("kvobserve_stream_up", ka)] == 0
    assert ("kvobserve_kv_blocks", ka) not in served  # its gauges leave at once
    assert ("kvobserve_kv_cache_usage_ratio", ka) not in served
    assert served[("kvobserve_kv_blocks", kb)] == len(b.truth)  # the other stays
    assert served[("kvobserve_kv_event_batches_total", ka)] == 3  # counters stay
    h.advance(DOWN_AFTER_S + 1)
    _send(h, m, b, 1)
    assert ("stream_down", ka) in h.conditions(m.workers())  # it pages
    assert ("stream_down", kb) not in h.conditions(m.workers())


@pytest.mark.parametrize("mode", cells("a_reconnect_of_the_same_publisher_recovers_what_it_missed"))
def test_a_reconnect_of_the_same_publisher_recovers_what_it_missed(mode: str) -> None:
    h, m, (e,) = _setup(mode)
    _send(h, m, e, 4)
    m.disconnect(e)
    assert not h.stream_stats(*m.key(e)).up
    for _ in range(2):  # published while the connection was down
        e.batch(h.wall)
    m.connect(e)
    _send(h, m, e, 3)
    s = h.stream_stats(*m.key(e))
    assert s.up and s.state == "up"
    assert (s.restarts, s.gaps, s.missed, s.recovered, s.lost) == (0, 1, 2, 2, 0)
    assert h.resident(*m.key(e)) == e.truth


@pytest.mark.parametrize("mode", cells("streams_past_max_streams_are_refused_and_counted"))
def test_streams_past_max_streams_are_refused_and_counted(mode: str) -> None:
    h, m, (a, b) = _setup(mode, n=2, options=IngestOptions(max_streams=1))
    _send(h, m, a, 2)
    _send(h, m, b, 2)
    st = h.stats()
    assert [(s.worker_id, s.dp_rank) for s in st.streams] == [m.key(a)]
    assert st.refused == {"streams": 1}
    assert h.resident(*m.key(a)) == a.truth


@pytest.mark.parametrize("mode", cells("metrics_render_in_every_mode"))
def test_metrics_render_in_every_mode(mode: str) -> None:
    from kvobserve.analysis.fleet import FleetState
    from kvobserve.export.scrape import ScrapeCache
    from kvobserve.export.series import Detail
    from tests.unit.test_export_scrape import check

    h, m, (a, b) = _setup(mode, n=2)
    _send(h, m, a, 3)
    _send(h, m, b, 3)
    m.disconnect(b)
    fs = FleetState()
    fs.update(h.snapshot(m.workers()), h.wall)
    view = fs.view(h.wall)
    for detail in (Detail(), Detail(per_stream_detail=True)):
        for om in (False, True):
            body = check(ScrapeCache(detail), view, om)  # both writers, the same bytes
            assert b"kvobserve_kv_blocks{" in body
    served = h.metrics(m.workers())
    assert served[("kvobserve_kv_blocks", f"{m.key(a)[0]}#{m.key(a)[1]}")] == len(a.truth)


def _restarted(mode: str, e: Engine, saved: bytes, key: tuple[str, int]) -> tuple[Harness, Mode]:
    """A new collector (a new core) with the checkpoint `saved` of `key`, watching `e` again."""
    h = Harness(checkpoints={key: saved})
    m = MODES[mode](h)
    m.plan(e)
    m.connect(e)
    return h, m


@pytest.mark.parametrize("mode", cells("a_restarted_collector_resumes_from_its_checkpoint"))
@pytest.mark.parametrize("case", ["exact", "ring_too_short", "engine_restarted"])
def test_a_restarted_collector_resumes_from_its_checkpoint(mode: str, case: str) -> None:
    ring = 4 if case == "ring_too_short" else 10_000
    h, m, (e,) = _setup(mode, ring=ring, keep=100, checkpoints=True)
    _send(h, m, e, 10)
    saved = h.checkpoint(m.key(e))  # the last round before kvobserve went down
    if case == "engine_restarted":
        e.restart()
    for _ in range(6):  # published while kvobserve was down
        e.batch(h.wall)
    h, m = _restarted(mode, e, saved, m.key(e))
    after = 6
    if mode in ("template", "relay"):  # a pod is known from its next message on
        _send(h, m, e, 1)
        after += 1
    s = h.stream_stats(*m.key(e))
    if case == "exact":  # the ring began with the checkpoint's batch: all of it applied
        assert (s.gaps, s.missed, s.recovered, s.lost, s.restarts) == (1, after, after, 0, 0)
        assert (s.trust, s.trust_reason) == ("replay_filled", "gap_replayed")
        assert h.resident(*m.key(e)) == e.truth
    elif case == "ring_too_short":  # the ring holds the last 4: the rest lost, the index partial
        lost = after - 4
        assert (s.gaps, s.missed, s.recovered, s.lost, s.restarts) == (1, after, 4, lost, 0)
        assert (s.trust, s.trust_reason) == ("partial", "lost_batches")
        assert h.resident(*m.key(e)) < e.truth
    else:  # another publisher process: the checkpoint is not its state
        assert (s.restarts, s.lost) == (1, 0)
        assert h.resident(*m.key(e)) <= e.truth
    _send(h, m, e, 2)  # and it goes on
    assert h.stream_stats(*m.key(e)).lost == (after - 4 if case == "ring_too_short" else 0)


def test_a_checkpoint_is_not_restored_without_a_replay_endpoint() -> None:
    h, m, (e,) = _setup("connect", replay=False, checkpoints=True)
    _send(h, m, e, 5)
    saved = h.checkpoint(m.key(e))
    h, m = _restarted("connect", e, saved, m.key(e))
    assert not any(type(a).__name__ == "Restore" for a in h.actions)  # nothing could confirm it
    assert h.resident(*m.key(e)) == set()


def test_an_index_that_joined_mid_stream_vouches_once_it_holds_the_engines_capacity() -> None:
    h, m, (e,) = _setup("connect", ring=3)  # the ring no longer reaches seq 0
    for _ in range(8):
        e.batch(h.wall)
    _send(h, m, e, 2)
    key = m.key(e)
    s = h.stream_stats(*key)
    assert (s.trust, s.vouched, s.vouch_reason) == ("partial", False, "joined_midstream")
    assert (s.lower_blocks, s.lower_tokens) == (len(h.resident(*key)), 16 * len(h.resident(*key)))
    full = 16.0 * e.keep  # the engine's capacity: what it holds once warm
    (s,) = h.stats({key: (full, h.wall)}).streams  # read after the join
    assert (s.vouched, s.vouch_reason) == (True, "holds_capacity")  # nothing can be missing
    assert h.resident(*key) == e.truth
    # a capacity read before the join says nothing about this index
    h2, m2, (e2,) = _setup("connect", ring=3)
    for _ in range(8):
        e2.batch(h2.wall)
    _send(h2, m2, e2, 2)
    (s,) = h2.stats({m2.key(e2): (full, h2.wall - 60)}).streams
    assert s.vouched is False


def test_a_resumed_index_is_unvouched_until_the_ring_confirms_it() -> None:
    h, m, (e,) = _setup("connect", keep=100, checkpoints=True)
    _send(h, m, e, 5)
    saved = h.checkpoint(m.key(e))
    for _ in range(3):
        e.batch(h.wall)
    h2 = Harness(checkpoints={m.key(e): saved}, auto_replay=False)
    m2 = MODES["connect"](h2)
    m2.plan(e)
    m2.connect(e)
    s = h2.stream_stats(*m2.key(e))
    assert (s.trust_reason, s.vouched) == ("resuming", False)  # restored, not confirmed: no number
    h2.pump()
    s = h2.stream_stats(*m2.key(e))
    assert (s.trust_reason, s.vouched, s.recovered) == ("gap_replayed", True, 3)
