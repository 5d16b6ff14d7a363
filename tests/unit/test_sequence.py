"""StreamSequencer and MirrorDetector: one test per stream-semantics rule."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvobserve.analysis.actions import Action, CancelReplay, RequestReplay
from kvobserve.analysis.blocks import BlockIndex
from kvobserve.analysis.mirror import MirrorDetector
from kvobserve.analysis.sequence import SequencerLimits, StreamSequencer
from kvobserve.wire.kv_events import END_SEQ, KvBatch, decode_message, decode_payload, decode_seq
from tests.examples import examples
from tests.unit.test_blocks import (
    capture_messages,
    cleared,
    stored,
    truth_after_each_batch,
)


class RecordingIndex(BlockIndex):
    """A BlockIndex that also records the (publisher, seq) of every batch applied."""

    def __init__(self) -> None:
        super().__init__()
        self.applied: list[tuple[str, int]] = []

    def apply_batch(self, batch: KvBatch) -> None:
        self.applied.append((batch.topic, batch.seq))
        super().apply_batch(batch)


def mk(
    seq: int, pub: str = "A", rank: int | None = 0, clear: bool = False
) -> tuple[KvBatch, bytes]:
    """A batch of publisher `pub` storing one block, and a payload unique to (pub, seq)."""
    h = hash((pub, seq)) & 0xFFFFFFFF
    ev = cleared() if clear else stored([h])
    return KvBatch(pub, seq, 1000.0 + seq, rank, [ev]), f"{pub}{seq}".encode()


def seqr(replay: bool, **kw: float) -> tuple[StreamSequencer, RecordingIndex]:
    idx = RecordingIndex()
    return StreamSequencer(0, replay=replay, index=idx, limits=SequencerLimits(**kw)), idx  # type: ignore[arg-type]


def feed(s: StreamSequencer, seqs: list[int], pub: str = "A", now: float = 0.0) -> list[Action]:
    actions = []
    for q in seqs:
        a = s.on_batch(*mk(q, pub), now)
        if a is not None:
            actions.append(a)
    return actions


def test_in_order_applies_and_is_complete_from_seq_0() -> None:
    s, idx = seqr(replay=False)
    assert feed(s, [0, 1, 2]) == []
    assert idx.applied == [("A", 0), ("A", 1), ("A", 2)]
    assert (s.batches_applied, s.last_seq, s.last_ts, s.state_complete) == (3, 2, 1002.0, True)
    assert s.gaps == s.missed == s.lost == 0


def test_gap_without_replay_is_lost_at_once() -> None:
    s, idx = seqr(replay=False)
    feed(s, [0, 1, 4, 5])
    assert (s.gaps, s.missed, s.lost, s.recovered) == (1, 2, 2, 0)
    assert s.state_complete is False
    assert [q for _, q in idx.applied] == [0, 1, 4, 5]


def test_gap_then_replay_applies_in_order_exactly_once() -> None:
    s, idx = seqr(replay=True)
    assert feed(s, [0, 1]) == []
    action = s.on_batch(*mk(5), 0.0)
    assert isinstance(action, RequestReplay) and action.start_seq == 2
    feed(s, [6, 7])  # held while the replay runs
    assert [q for _, q in idx.applied] == [0, 1]
    for q in (2, 3, 4, 5, 6):  # the ring also holds batches live already delivered
        s.on_replay_batch(action.replay_id, mk(q)[0])
    s.on_replay_end(action.replay_id)
    assert [q for _, q in idx.applied] == list(range(8))
    assert (s.gaps, s.missed, s.recovered, s.lost) == (1, 3, 3, 0)
    assert s.replay_requests["ok"] == 1
    assert s.state_complete is True
    assert s.index.store_of_resident_total == 0
    assert feed(s, [8]) == [] and s.last_seq == 8


def test_replay_starting_later_than_asked_loses_the_part_before() -> None:
    s, idx = seqr(replay=True)
    feed(s, [0])
    (req,) = feed(s, [5])
    assert isinstance(req, RequestReplay) and req.start_seq == 1
    for q in (3, 4):
        s.on_replay_batch(req.replay_id, mk(q)[0])
    s.on_replay_end(req.replay_id)
    assert [q for _, q in idx.applied] == [0, 3, 4, 5]
    assert (s.missed, s.recovered, s.lost) == (4, 2, 2)
    assert s.replay_requests["partial"] == 1
    assert s.state_complete is False


def test_replay_timeout_gives_up_and_applies_the_held_batches() -> None:
    s, idx = seqr(replay=True, replay_timeout_s=5.0)
    feed(s, [0, 3], now=100.0)
    assert s.replay_in_flight is not None
    feed(s, [4], now=101.0)
    assert s.expire(104.9) is None
    action = s.expire(105.0)
    assert isinstance(action, CancelReplay)
    assert [q for _, q in idx.applied] == [0, 3, 4]
    assert (s.missed, s.lost, s.replay_requests["timeout"]) == (2, 2, 1)
    assert s.replay_in_flight is None


def test_replay_error_and_stale_replies_are_handled() -> None:
    s, idx = seqr(replay=True)
    feed(s, [0])
    (req,) = feed(s, [2])
    s.on_replay_batch(req.replay_id + 7, mk(1)[0])  # not ours: ignored
    s.on_replay_end(req.replay_id, "error")
    s.on_replay_batch(req.replay_id, mk(1)[0])  # too late: ignored
    assert [q for _, q in idx.applied] == [0, 2]
    assert (s.lost, s.replay_requests["error"]) == (1, 1)


def test_hold_buffer_overflow_gives_up_and_loses_the_rest() -> None:
    s, idx = seqr(replay=True, hold_limit=3)
    feed(s, [0])
    (req,) = feed(s, [2])
    assert feed(s, [3, 4]) == []
    (cancel,) = feed(s, [5])
    assert cancel == CancelReplay(req.replay_id)
    assert [q for _, q in idx.applied] == [0, 2, 3, 4, 5]
    assert (s.lost, s.replay_requests["overflow"]) == (1, 1)


def test_duplicate_delivery_is_counted_and_ignored() -> None:
    s, idx = seqr(replay=False)
    feed(s, [0, 1, 1, 2, 1])
    assert s.duplicate_batches == 2
    assert [q for _, q in idx.applied] == [0, 1, 2]
    assert s.restarts == s.gaps == 0


def test_restart_resets_the_index_without_a_gap() -> None:
    s, idx = seqr(replay=False)
    feed(s, list(range(6)), pub="A")
    feed(s, [0, 1, 2, 3], pub="B")
    assert s.restarts == 1
    assert (s.gaps, s.missed, s.lost) == (0, 0, 0)
    assert idx.applied[6:] == [("B", 0), ("B", 1), ("B", 2), ("B", 3)]
    assert len(s.index.resident_hashes()["GPU"]) == 4  # only the new publisher's blocks
    assert s.state_complete is True
    assert s.duplicate_stream(0.0) is False


def test_restart_is_confirmed_by_time_when_the_new_publisher_is_quiet() -> None:
    s, idx = seqr(replay=False, restart_confirm_s=2.0)
    feed(s, [0, 1, 2], pub="A", now=10.0)
    feed(s, [0], pub="B", now=11.0)
    assert s.restarts == 0 and s.expire(12.9) is None
    s.expire(13.0)
    assert s.restarts == 1 and idx.applied[-1] == ("B", 0)


def test_restart_midway_with_replay_asks_from_0() -> None:
    s, _ = seqr(replay=True)
    feed(s, list(range(10)), pub="A")
    actions = feed(s, [4, 5, 6], pub="B")
    assert s.restarts == 1
    assert actions == [RequestReplay(1, 0)]  # the new publisher joined at 4: replay it from 0
    s.on_replay_end(1)
    assert s.state_complete is False  # nothing came back: 0..3 of the new publisher are unknown


def interleave(a: list[int], b: list[int]) -> list[tuple[str, int]]:
    out = []
    for x, y in zip(a, b, strict=True):
        out += [("A", x), ("B", y)]
    return out


def test_interleaved_publishers_are_a_duplicate_stream_not_restarts() -> None:
    s, idx = seqr(replay=False)
    for pub, q in interleave(list(range(500, 540)), list(range(40))):
        s.on_batch(*mk(q, pub), 50.0)
    assert (s.restarts, s.gaps, s.missed, s.lost) == (0, 0, 0, 0)
    assert s.duplicate_stream(50.0) is True
    assert s.duplicate_stream(79.9) is True and s.duplicate_stream(80.0) is False
    assert {p for p, _ in idx.applied} == {"A"}  # the second publisher's batches are dropped
    assert s.interleaved_batches == 40
    assert s.state_complete is False


def test_interleaved_with_equal_seqs_and_different_payloads() -> None:
    s, _ = seqr(replay=False)
    for pub, q in interleave(list(range(30)), list(range(30))):
        s.on_batch(*mk(q, pub), 1.0)
    assert (s.restarts, s.gaps, s.duplicate_batches) == (0, 0, 0)
    assert s.duplicate_stream(1.0) is True


def test_restart_and_interleaving_are_told_apart() -> None:
    restart, _ = seqr(replay=False)
    feed(restart, list(range(100, 110)), pub="A")
    feed(restart, list(range(10)), pub="B")
    both, _ = seqr(replay=False)
    for pub, q in interleave(list(range(100, 110)), list(range(10))):
        both.on_batch(*mk(q, pub), 0.0)
    assert (restart.restarts, restart.duplicate_stream(0.0)) == (1, False)
    assert (both.restarts, both.duplicate_stream(0.0)) == (0, True)


def test_bursty_interleaving_counts_at_most_one_restart() -> None:
    s, _ = seqr(replay=False)
    a, b = iter(range(1000, 2000)), iter(range(1000))
    for _ in range(20):  # bursts of 5 from each publisher
        feed(s, [next(a) for _ in range(5)], pub="A")
        feed(s, [next(b) for _ in range(5)], pub="B")
    assert s.restarts <= 1 and s.gaps == 0 and s.missed == 0
    assert s.duplicate_stream(0.0) is True


def test_gap_right_after_a_restart_near_the_retired_seq_does_not_stall() -> None:
    s, idx = seqr(replay=False)
    feed(s, list(range(11)), pub="A")  # retired head ends at 10
    feed(s, list(range(9)), pub="B")
    feed(s, list(range(11, 60)), pub="B")  # 9, 10 lost: 11 looks like the retired head's next
    assert s.restarts == 1
    assert s.last_seq == 59 and idx.applied[-1] == ("B", 59)


def test_joined_mid_stream_with_replay_from_0_is_complete() -> None:
    s, idx = seqr(replay=True)
    (req,) = feed(s, [7])
    assert req == RequestReplay(req.replay_id, 0)
    assert s.state_complete is False
    for q in range(7):
        s.on_replay_batch(req.replay_id, mk(q)[0])
    s.on_replay_end(req.replay_id)
    assert [q for _, q in idx.applied] == list(range(8))
    assert s.state_complete is True
    assert (s.missed, s.lost, s.recovered) == (0, 0, 0)


def test_joined_mid_stream_ring_too_short_is_incomplete_but_not_lost() -> None:
    s, _ = seqr(replay=True)
    (req,) = feed(s, [7])
    for q in range(3, 7):
        s.on_replay_batch(req.replay_id, mk(q)[0])
    s.on_replay_end(req.replay_id)
    assert s.state_complete is False
    assert (s.missed, s.lost) == (0, 0)
    assert s.replay_requests["partial"] == 1


def test_joined_mid_stream_without_replay_until_a_clear() -> None:
    s, _ = seqr(replay=False)
    feed(s, [7, 8])
    assert s.state_complete is False
    s.on_batch(*mk(9, clear=True), 0.0)
    assert s.state_complete is True


def test_rank_mismatch_is_counted_and_still_applied() -> None:
    s = StreamSequencer(1, replay=False)
    s.on_batch(*mk(0, rank=0), 0.0)
    s.on_batch(*mk(1, rank=1), 0.0)
    s.on_batch(*mk(2, rank=None), 0.0)
    assert s.rank_mismatch_batches == 1 and s.batches_applied == 3


def test_mirrored_streams_flag_both() -> None:
    det = MirrorDetector(capacity=4)
    r0, r1, r2 = (StreamSequencer(r, replay=False) for r in range(3))
    assert det.observe(r0, (0, 1.5, 90), now=5.0) is None
    assert det.observe(r0, (0, 1.5, 90), now=5.0) is None  # same stream again: no mirror
    assert det.observe(r2, (0, 1.6, 90), now=5.0) is None
    assert det.observe(r1, (0, 1.5, 90), now=6.0) is r0
    assert r0.duplicate_stream(6.0) and r1.duplicate_stream(6.0)
    assert not r2.duplicate_stream(6.0)
    for i in range(10):  # memory stays bounded: old fingerprints are forgotten
        det.observe(r2, (i + 1, 0.0, 1), now=7.0)
    assert len(det._owner) <= 4
    assert det.observe(r1, (0, 1.6, 90), now=8.0) is None


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=60), st.integers(1, 8), st.integers(0, 6))
def test_any_live_loss_with_a_full_ring_applies_every_seq_once_in_order(
    delivered: list[bool], hold_limit: int, delay: int
) -> None:
    """Live delivers a subset; a replay answers `delay` live batches later with the full ring."""
    s, idx = seqr(replay=True, hold_limit=hold_limit)
    n = len(delivered)
    pending: list[int] = []  # [replay_id, start_seq, live batches left before the reply]

    def serve(upto: int) -> None:
        for r in range(pending[1], upto + 1):
            s.on_replay_batch(pending[0], mk(r)[0])
        s.on_replay_end(pending[0])
        pending.clear()

    for q, ok in enumerate([*delivered, True]):  # the last one always arrives
        if ok:
            action = s.on_batch(*mk(q), 0.0)
            if isinstance(action, RequestReplay):
                pending[:] = [action.replay_id, action.start_seq, delay]
            elif isinstance(action, CancelReplay):
                pending.clear()
            elif pending:
                pending[2] -= 1
        if pending and pending[2] <= 0:
            serve(q)
    if pending:
        serve(n)
    applied = [q for _, q in idx.applied]
    assert applied == sorted(set(applied))  # in order, exactly once
    assert s.lost == s.missed - s.recovered
    if s.replay_requests["overflow"] == 0:
        assert applied == list(range(n + 1))
        first = [*delivered, True].index(True)  # earlier ones: joined mid-stream, not missed
        assert s.lost == 0 and s.missed == delivered[first:].count(False)


def test_real_capture_gap_recovered_from_the_engines_replay_frames() -> None:
    version = "sglang-0.5.23"
    for rank in (0, 1):
        live = [
            decode_message(m["frames"]) for m in capture_messages(version) if m["dp_rank"] == rank
        ]
        s = StreamSequencer(rank, replay=True)
        req = None
        for b in live:
            if b.seq in (3, 4):
                continue  # lost on the PUB socket
            payload = b"%d" % b.seq
            req = s.on_batch(b, payload, 0.0) or req
        assert isinstance(req, RequestReplay) and req.start_seq == 3
        for m in capture_messages(version, "replay"):
            if m["dp_rank"] != rank:
                continue
            *_, seq_frame, payload = m["frames"]
            if seq_frame == END_SEQ:
                s.on_replay_end(req.replay_id)
                break
            topic = m["frames"][1].decode() if len(m["frames"]) == 4 else ""
            s.on_replay_batch(req.replay_id, decode_payload(topic, decode_seq(seq_frame), payload))
        truth = truth_after_each_batch(version, rank)
        assert s.index.resident_hashes()["GPU"] == truth[-1][0]["GPU"]
        assert (s.missed, s.recovered, s.lost, s.batches_applied) == (2, 2, 0, len(truth))
        assert s.replay_requests["ok"] == 1 and s.state_complete


def test_a_hole_younger_than_the_reply_is_asked_for_again() -> None:
    """The engine answers with its ring as of the request; a live loss after that is not lost."""
    s, idx = seqr(replay=True)
    feed(s, [0])
    (req,) = feed(s, [3])  # the engine's ring now holds 0..3
    assert feed(s, [4, 6]) == []  # 5 lost on the wire after the engine answered
    for q in (1, 2, 3):
        s.on_replay_batch(req.replay_id, mk(q)[0])
    again = s.on_replay_end(req.replay_id, "ok", now=1.0)
    assert again == RequestReplay(req.replay_id + 1, 5)
    assert [q for _, q in idx.applied] == [0, 1, 2, 3, 4]
    for q in (5, 6):
        s.on_replay_batch(again.replay_id, mk(q)[0])
    assert s.on_replay_end(again.replay_id) is None
    assert [q for _, q in idx.applied] == list(range(7))
    assert (s.gaps, s.missed, s.recovered, s.lost) == (2, 3, 3, 0)
    assert s.replay_requests["ok"] == 2 and s.state_complete is True


def test_a_replayed_batch_ahead_of_live_fills_a_later_live_loss() -> None:
    """The reply carries seqs live has not delivered yet; if live then loses one, use the reply's."""
    s, idx = seqr(replay=True)
    feed(s, [0])
    (req,) = feed(s, [2])
    for q in (1, 2, 3, 4):  # 3 and 4 were published before the engine answered
        s.on_replay_batch(req.replay_id, mk(q)[0])
    assert feed(s, [4]) == []  # live loses 3
    assert s.on_replay_end(req.replay_id) is None
    assert [q for _, q in idx.applied] == [0, 1, 2, 3, 4]
    assert (s.missed, s.recovered, s.lost) == (2, 2, 0)
    assert s.replay_requests["ok"] == 1 and s.state_complete is True


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=60), st.integers(0, 6), st.integers(0, 3))
def test_replies_as_of_the_request_recover_every_live_loss(
    delivered: list[bool], delay: int, lead: int
) -> None:
    """The engine snapshots its full ring when asked (`lead` seqs past the live batch that
    triggered the request); the reply arrives `delay` live batches later."""
    s, idx = seqr(replay=True)
    sent = [*delivered, True]  # the last one always arrives
    pending: list[int] = []  # [replay_id, start, ring end, live batches left before the reply]

    def ask(action: RequestReplay | None, q: int) -> None:
        if action is not None:
            pending[:] = [action.replay_id, action.start_seq, min(q + lead, len(sent) - 1), delay]

    def serve(now_published: int) -> None:
        rid, start, end, _ = pending
        pending.clear()
        for r in range(start, end + 1):
            s.on_replay_batch(rid, mk(r)[0])
        ask(s.on_replay_end(rid), now_published)

    for q, ok in enumerate(sent):
        if ok:
            action = s.on_batch(*mk(q), 0.0)
            if isinstance(action, RequestReplay):
                ask(action, q)
            elif pending:
                pending[3] -= 1
        while pending and pending[3] <= 0:
            serve(q)
    while pending:
        serve(len(sent) - 1)
    applied = [q for _, q in idx.applied]
    first = sent.index(True)  # earlier ones: joined mid-stream, replayed from 0, not missed
    assert applied == list(range(len(sent)))
    assert s.lost == 0 and s.missed == s.recovered == sent[first:].count(False)
    assert s.state_complete is True


# --- tail checks: an idle stream asks for batches after its last seq (analysis/tail.py) ---------


def ask_tail(s: StreamSequencer, now: float, last_at: float = 0.0, **kw: bool) -> RequestReplay:
    req = s.check_tail(now, last_at, **kw)
    assert isinstance(req, RequestReplay) and req.tail, req
    return req


def test_idle_stream_with_nothing_lost_asks_once_and_counts_nothing() -> None:
    s, idx = seqr(replay=True)
    feed(s, [0, 1, 2])
    assert s.check_tail(1.9, 0.0) is None  # still active
    req = ask_tail(s, 2.0)
    assert req.start_seq == 3  # everything after the last seq
    assert s.check_tail(2.5, 0.0) is None  # one check at a time
    assert s.on_replay_end(req.replay_id, "ok", 2.1) is None  # the end marker alone
    assert (s.gaps, s.missed, s.recovered, s.lost) == (0, 0, 0, 0)
    assert [q for _, q in idx.applied] == [0, 1, 2]
    assert s.replay_requests == dict.fromkeys(s.replay_requests, 0)
    assert (s.trust.state, s.trust_reason(9.0, 0.0, connected=True)) == ("complete", "from_start")
    assert s.check_tail(5.9, 0.0) is None and ask_tail(s, 6.0).start_seq == 3  # backing off


def test_a_batch_lost_at_the_end_of_a_burst_is_recovered_by_the_tail_check() -> None:
    s, idx = seqr(replay=True)
    feed(s, [0, 1, 2, 3, 4])  # 5 lost on the wire, then the publisher is idle
    req = ask_tail(s, 2.0)
    s.on_replay_batch(req.replay_id, mk(5)[0], mk(5)[1], 2.1)
    assert s.on_replay_end(req.replay_id, "ok", 2.1) is None
    assert [q for _, q in idx.applied] == list(range(6))
    assert (s.gaps, s.missed, s.recovered, s.lost) == (1, 1, 1, 0)
    assert s.replay_requests["ok"] == 1
    assert (s.trust.state, s.trust.reason) == ("replay_filled", "gap_replayed")
    assert ("gap", 5, 5, 2.0) in s.notes
    # the next check comes 2 s after this one (the reply was the last news), and finds nothing
    assert s.check_tail(3.9, 0.0) is None
    again = ask_tail(s, 4.0)
    assert again.start_seq == 6
    s.on_replay_end(again.replay_id, "ok", 4.1)
    assert (s.gaps, s.replay_requests["ok"]) == (1, 1)


def test_a_tail_whose_start_left_the_ring_loses_that_part() -> None:
    s, idx = seqr(replay=True)
    feed(s, [0, 1])
    req = ask_tail(s, 2.0)
    for q in (4, 5):  # the ring no longer holds 2 and 3
        s.on_replay_batch(req.replay_id, mk(q)[0], mk(q)[1], 2.1)
    s.on_replay_end(req.replay_id, "ok", 2.1)
    assert [q for _, q in idx.applied] == [0, 1, 4, 5]
    assert (s.gaps, s.missed, s.recovered, s.lost) == (1, 4, 2, 2)
    assert s.replay_requests["partial"] == 1 and s.trust.reason == "lost_batches"


def test_live_copies_of_tail_batches_arriving_late_are_duplicates_not_a_restart() -> None:
    """The reply can overtake live: batches live was still delivering are applied once."""
    s, idx = seqr(replay=True)
    feed(s, [0])
    req = ask_tail(s, 2.0)
    for q in range(1, 21):  # more than the 8 payloads the sequencer keeps for duplicates
        s.on_replay_batch(req.replay_id, *mk(q), 2.1)
    s.on_replay_end(req.replay_id, "ok", 2.1)
    assert feed(s, list(range(1, 22)), now=2.2) == []  # live catches up, then goes on
    assert [q for _, q in idx.applied] == list(range(22))
    assert (s.restarts, s.duplicate_batches, s.interleaved_batches) == (0, 20, 0)
    assert s.recovered == 20  # they were not lost: counted as found by the check


def test_live_batches_during_a_tail_check_are_held_and_applied_once_in_order() -> None:
    s, idx = seqr(replay=True)
    feed(s, [0, 1])
    req = ask_tail(s, 2.0)
    assert feed(s, [2, 4], now=2.05) == []  # a new burst starts; 3 lost on the wire
    for q in (2, 3, 4, 5):  # the ring as of the answer
        s.on_replay_batch(req.replay_id, *mk(q), 2.1)
    assert s.on_replay_end(req.replay_id, "ok", 2.1) is None
    assert feed(s, [6], now=2.2) == []
    assert [q for _, q in idx.applied] == list(range(7))
    assert (s.gaps, s.missed, s.recovered, s.lost) == (2, 2, 2, 0)  # 3 (live gap), 5 (tail)


def test_a_failed_tail_check_counts_nothing_and_leaves_the_tail_unverified() -> None:
    s, _ = seqr(replay=True, replay_timeout_s=5.0)
    feed(s, [0, 1])
    ask_tail(s, 2.0)
    assert isinstance(s.expire(7.0), CancelReplay)
    assert s.replay_requests == dict.fromkeys(s.replay_requests, 0) and s.gaps == 0
    assert (s.trust.state, s.trust_reason(8.0, 0.0, connected=True)) == (
        "complete",
        "tail_unverified",
    )
    # the next check is on the schedule (4 s after the first), and an empty reply verifies
    assert s.check_tail(5.9, 0.0) is None
    req = ask_tail(s, 7.0)
    s.on_replay_end(req.replay_id, "ok", 7.1)
    assert s.trust_reason(8.0, 0.0, connected=True) == "from_start"


def test_without_replay_an_idle_tail_is_unverified_but_nothing_is_missing() -> None:
    s, _ = seqr(replay=False)
    feed(s, [0, 1])
    assert s.check_tail(100.0, 0.0) is None  # nobody to ask
    assert s.trust_reason(1.0, 0.0, connected=True) == "from_start"  # active
    assert s.trust_reason(2.0, 0.0, connected=True) == "tail_unverified"
    assert (s.trust.state, s.state_complete) == ("complete", True)
    feed(s, [5])  # a real loss: the loss is the reason, not the tail
    assert s.trust_reason(9.0, 0.0, connected=True) == "lost_batches"


def test_after_a_reconnect_the_tail_check_asks_from_the_last_seq_and_matches_its_bytes() -> None:
    s, idx = seqr(replay=True)
    feed(s, [0, 1, 2])
    req = ask_tail(s, 2.0, reconnected=True)
    assert req.start_seq == 2  # the last seq itself, to recognise the publisher by
    s.on_replay_batch(req.replay_id, *mk(2), 2.1)  # the very batch we applied: same publisher
    s.on_replay_batch(req.replay_id, *mk(3), 2.1)
    s.on_replay_end(req.replay_id, "ok", 2.1)
    assert [q for _, q in idx.applied] == [0, 1, 2, 3]
    assert (s.gaps, s.missed, s.recovered, s.restarts) == (1, 1, 1, 0)


def test_a_restarted_publisher_past_our_seq_is_a_restart_not_our_tail() -> None:
    """After a reconnect the ring holds another batch under our last seq: nothing of it is
    applied to our index; the restart is counted and the index starts again."""
    s, idx = seqr(replay=True)
    feed(s, [0, 1, 2])
    req = ask_tail(s, 2.0, reconnected=True)
    assert s.on_replay_batch(req.replay_id, *mk(2, "B"), 2.1) is None
    s.on_replay_batch(req.replay_id, *mk(3, "B"), 2.1)  # stale: the check is over
    assert s.replay_in_flight is None
    assert idx.applied == [("A", 0), ("A", 1), ("A", 2)]
    assert (s.restarts, s.gaps, s.batches_applied, s.last_seq) == (1, 0, 3, None)
    assert s.index.resident_hashes() == {"GPU": set()}  # the old publisher's blocks are gone
    assert (s.trust.state, s.trust.reason) == ("partial", "waiting")
    # the new publisher's next live batch joins mid-stream and asks for its history from 0
    join = s.on_batch(*mk(4, "B"), 3.0)
    assert isinstance(join, RequestReplay) and join.start_seq == 0 and not join.tail


def test_after_a_reconnect_a_ring_without_our_last_seq_cannot_vouch() -> None:
    s, idx = seqr(replay=True)
    feed(s, [0, 1, 2])
    req = ask_tail(s, 2.0, reconnected=True)
    s.on_replay_end(req.replay_id, "ok", 2.1)  # nothing at or after seq 2 (a younger publisher?)
    assert [q for _, q in idx.applied] == [0, 1, 2]
    assert (s.restarts, s.gaps, s.replay_requests["ok"]) == (0, 0, 0)
    assert s.trust_reason(3.0, 0.0, connected=True) == "tail_unverified"
    req = ask_tail(s, 6.0, reconnected=True)
    s.on_replay_batch(req.replay_id, *mk(5, "B"), 6.1)  # starts past it: cannot vouch either
    assert s.replay_in_flight is None and [q for _, q in idx.applied] == [0, 1, 2]
    assert s.trust_reason(7.0, 0.0, connected=True) == "tail_unverified"


def test_no_tail_check_while_a_replay_runs_or_two_publishers_share_the_stream() -> None:
    s, _ = seqr(replay=True)
    feed(s, [0, 3])  # a gap replay in flight
    assert s.check_tail(10.0, 0.0) is None
    d, _ = seqr(replay=True)
    for pub, q in interleave([0, 1, 2, 3], [0, 1, 2, 3]):
        d.on_batch(*mk(q, pub), 0.0)
    assert d.duplicate_stream(10.0) and d.check_tail(10.0, 0.0) is None


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.booleans(), min_size=2, max_size=60), st.integers(0, 3))
def test_any_live_loss_including_the_tail_is_recovered_once_idle(
    delivered: list[bool], lead: int
) -> None:
    """Live delivers a subset, the last batches included or not; gap replays answer at once with
    the ring as of the request; once idle, tail checks recover whatever is still missing."""
    s, idx = seqr(replay=True)
    n = len(delivered)
    ring_end = -1  # the publisher's last seq so far

    def answer(req: Action | None) -> None:
        while isinstance(req, RequestReplay):
            for r in range(req.start_seq, ring_end + 1):
                s.on_replay_batch(req.replay_id, *mk(r), 0.0)
            req = s.on_replay_end(req.replay_id, "ok", 0.0)

    for q, ok in enumerate(delivered):
        ring_end = min(q + lead, n - 1) if ok else q
        if ok:
            answer(s.on_batch(*mk(q), 0.0))
    ring_end = n - 1
    now = 0.0
    while s.tail.outcome != "verified" and now < 100.0:  # bounded: the schedule backs off
        now += 1.0
        answer(s.check_tail(now, 0.0))
    first = delivered.index(True) if True in delivered else None
    applied = [q for _, q in idx.applied]
    if first is None:
        assert applied == [] and s.tail.outcome == ""  # never heard of the stream: nothing to ask
        return
    assert applied == list(range(n))
    assert s.lost == 0 and s.missed == s.recovered == delivered[first:].count(False)
    assert s.trust_reason(now + 1.0, 0.0, connected=True) in ("from_start", "replayed_from_start",
                                                             "gap_replayed")  # fmt: skip


# --- resuming from a checkpoint (docs/reliability.md) ------------------------------------------


def _resumed(last: int = 9) -> tuple[StreamSequencer, RecordingIndex, RequestReplay]:
    s, idx = seqr(replay=True)
    ask = s.resume(last, mk(last)[1], ("complete", "from_start"), 100.0)
    assert isinstance(ask, RequestReplay) and (ask.start_seq, ask.tail) == (last, True)
    assert (s.trust.state, s.trust.reason, s.resuming) == ("partial", "resuming", True)
    return s, idx, ask


def test_a_resume_whose_ring_begins_with_the_checkpointed_batch_goes_on_exactly() -> None:
    s, idx, ask = _resumed(9)
    for q in (9, 10, 11):  # the checkpoint's last batch, then what was missed while down
        assert s.on_replay_batch(ask.replay_id, *mk(q), 101.0) is None
    s.on_replay_end(ask.replay_id, "ok", 101.0)
    assert [q for _, q in idx.applied] == [10, 11]
    assert (s.gaps, s.missed, s.recovered, s.lost, s.restarts) == (1, 2, 2, 0, 0)
    assert (s.trust.state, s.trust.reason, s.resuming) == ("replay_filled", "gap_replayed", False)
    assert feed(s, [12], now=102.0) == [] and s.last_seq == 12


def test_a_resume_with_nothing_missed_gives_the_checkpoint_s_trust_back() -> None:
    s, idx, ask = _resumed(9)
    s.on_replay_batch(ask.replay_id, *mk(9), 101.0)
    s.on_replay_end(ask.replay_id, "ok", 101.0)
    assert idx.applied == [] and (s.gaps, s.recovered, s.lost) == (0, 0, 0)
    assert (s.trust.state, s.trust.reason) == ("complete", "from_start")


def test_a_resume_facing_another_batch_under_its_seq_is_a_restart() -> None:
    s, _idx, ask = _resumed(9)
    s.on_replay_batch(ask.replay_id, *mk(9, pub="B"), 101.0)  # another process's seq 9
    assert (s.restarts, s.last_seq, s.resuming) == (1, None, False)
    assert (s.trust.state, s.trust.reason) == ("partial", "waiting")


def test_a_resume_whose_ring_holds_nothing_from_its_seq_is_a_restart() -> None:
    s, _idx, ask = _resumed(400)  # the publisher restarted and is at seq 50: nothing >= 400
    s.on_replay_end(ask.replay_id, "ok", 101.0)
    assert (s.restarts, s.last_seq, s.resuming) == (1, None, False)
    feed(s, [51], now=102.0)  # its next batch joins mid-stream (and asks its ring from 0)
    assert (s.trust.state, s.trust.reason) == ("partial", "joined_midstream")


def test_a_resume_past_the_ring_loses_what_lies_between_and_applies_the_rest() -> None:
    s, idx, ask = _resumed(9)
    for q in (14, 15):  # the ring begins at 14: 10-13 are gone
        s.on_replay_batch(ask.replay_id, *mk(q), 101.0)
    s.on_replay_end(ask.replay_id, "ok", 101.0)
    assert [q for _, q in idx.applied] == [14, 15]
    assert (s.gaps, s.missed, s.recovered, s.lost) == (1, 6, 2, 4)
    assert (s.trust.state, s.trust.reason, s.resuming) == ("partial", "lost_batches", False)
    assert s.replay_requests == dict.fromkeys(s.replay_requests, 0) | {"partial": 1}


def test_live_batches_during_a_resume_are_held_and_applied_in_order() -> None:
    s, idx, ask = _resumed(9)
    assert feed(s, [12, 13], now=100.5) == []  # live, while the reply is on its way
    for q in (9, 10, 11, 12):
        s.on_replay_batch(ask.replay_id, *mk(q), 101.0)
    s.on_replay_end(ask.replay_id, "ok", 101.0)
    assert [q for _, q in idx.applied] == [10, 11, 12, 13]
    assert (s.lost, s.trust.reason) == (0, "gap_replayed")


def test_a_resume_that_times_out_stays_unconfirmed_and_asks_again_later() -> None:
    s, _idx, _ask = _resumed(9)
    assert isinstance(s.expire(106.0), CancelReplay)  # the replay socket did not answer
    assert (s.trust.reason, s.resuming) == ("resuming", True)
    again = s.check_tail(110.0, 100.0, reconnected=True)  # the tail schedule, anchored
    assert isinstance(again, RequestReplay) and again.start_seq == 9
    s.on_replay_batch(again.replay_id, *mk(9), 110.5)
    s.on_replay_end(again.replay_id, "ok", 110.5)
    assert (s.trust.reason, s.resuming) == ("from_start", False)


def test_without_a_replay_endpoint_nothing_can_confirm_a_resume() -> None:
    s, _ = seqr(replay=False)
    assert s.resume(9, b"x", ("complete", "from_start"), 100.0) is None
