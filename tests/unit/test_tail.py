"""TailWatch: the tail-check schedule of an idle stream and what it knows of the tail (times in)."""

from __future__ import annotations

from kvobserve.analysis.tail import FAILED, VERIFIED, TailWatch


def checks(w: TailWatch, last_seq: int | None, last_at: float, until: float) -> list[float]:
    """The times a tick every 0.5 s from `last_at` on asks (nothing answers)."""
    out, now = [], last_at
    while now <= until:
        if w.due(now, last_seq, last_at):
            out.append(now - last_at)
        now += 0.5
    return out


def test_first_check_two_seconds_after_the_last_batch_then_doubling_up_to_a_minute() -> None:
    w = TailWatch(2.0, 60.0)
    assert checks(w, 7, 100.0, 100.0 + 250) == [2, 6, 14, 30, 62, 122, 182, 242]


def test_no_check_before_the_first_batch() -> None:
    w = TailWatch(2.0, 60.0)
    assert checks(w, None, 0.0, 100.0) == []


def test_a_new_batch_starts_the_schedule_again_from_it() -> None:
    w = TailWatch(2.0, 60.0)
    assert checks(w, 7, 0.0, 20.0) == [2, 6, 14]
    assert not w.due(20.5, 8, 20.0)  # a batch at 20 s: the next check is at 22 s, not 30 s
    assert w.due(22.0, 8, 20.0)
    assert not w.due(25.5, 8, 20.0) and w.due(26.0, 8, 20.0)


def test_after_a_check_found_batches_the_next_waits_from_the_check() -> None:
    """Batches a check applied arrived with the reply, not live: count the silence from the ask."""
    w = TailWatch(2.0, 60.0)
    assert w.due(12.0, 7, 10.0)
    # the reply carried seq 8; live's last batch is still the one of 10 s
    assert not w.due(12.5, 8, 10.0)
    assert not w.due(13.5, 8, 10.0)
    assert w.due(14.0, 8, 10.0)


def test_unverified_only_when_idle_and_nobody_can_vouch_for_the_tail() -> None:
    w = TailWatch(2.0, 60.0)
    # active: the next batch will tell
    assert not w.unverified(11.5, 7, 10.0, askable=False)
    # idle, nobody to ask (no replay endpoint, or not connected)
    assert w.unverified(12.0, 7, 10.0, askable=False)
    # idle with replay: not asked yet is no news; a failed check is
    assert not w.unverified(12.0, 7, 10.0, askable=True)
    assert w.due(12.0, 7, 10.0)
    w.settle(False)
    assert w.outcome == FAILED and w.unverified(13.0, 7, 10.0, askable=True)
    # the next check comes back empty: verified
    assert w.due(16.0, 7, 10.0)
    w.settle(True)
    assert w.outcome == VERIFIED and not w.unverified(17.0, 7, 10.0, askable=True)
    # a failure is about one last seq: a newer batch is not known to be unverified yet
    w.settle(False)
    assert not w.unverified(30.0, 8, 20.0, askable=True)
    # before any batch the trust is `waiting` anyway
    assert not w.unverified(30.0, None, 0.0, askable=False)
