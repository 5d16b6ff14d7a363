"""When an idle stream asks its replay ring for batches after its last seq, and what is known of
that tail (docs/stream-semantics.md, "Tail checks"). Pure: times are a monotonic `now`, passed in.

A gap shows only when the next batch arrives, so a batch lost at the end of a burst stays unseen
while the publisher is idle. The schedule: the first check `first_s` after the last batch, then
each wait twice the one before (4, 8, 16, 32 s after the previous check), at most `max_wait_s`
(every 60 s) while the stream stays idle: checks at 2, 6, 14, 30, 62, 122, ... s of silence. Any
new batch, live or found by a check, starts the schedule again.
"""

from __future__ import annotations

import math

VERIFIED = "verified"  # a check for this last seq came back with nothing after it
FAILED = "failed"  # it timed out, failed, or the ring could not vouch for this publisher


class TailWatch:
    """The tail-check schedule of one stream and the outcome of its last check."""

    __slots__ = ("_anchor", "_asked_at", "_first", "_max", "_next", "_wait", "outcome")

    def __init__(self, first_s: float, max_wait_s: float) -> None:
        self._first, self._max = first_s, max_wait_s
        self._anchor: int | None = None  # the last seq the schedule is about
        self._asked_at = -math.inf
        self._next = math.inf
        self._wait = first_s
        self.outcome = ""  # "" (not asked about this last seq), VERIFIED or FAILED

    def due(self, now: float, last_seq: int | None, last_at: float) -> bool:
        """Whether to ask now (`last_at`: when the last batch arrived); a yes books the next one."""
        if last_seq is None:
            self._anchor = None
            return False
        if last_seq != self._anchor:  # batches since the last look: a new silence starts
            self._anchor, self._wait, self.outcome = last_seq, self._first, ""
            # a check that found batches was itself the last news: wait from it, not from live
            self._next = max(last_at, self._asked_at) + self._first
        if now < self._next:
            return False
        self._asked_at = now
        self._wait = min(self._wait * 2, self._max)
        self._next = now + self._wait
        return True

    def settle(self, verified: bool) -> None:
        """The outcome of the check in flight."""
        self.outcome = VERIFIED if verified else FAILED

    def unverified(self, now: float, last_seq: int | None, last_at: float, askable: bool) -> bool:
        """Whether an idle stream's last batch is not known to be its publisher's last: nobody can
        be asked (`askable` False: no replay endpoint, or not connected) or the last check failed.
        An active stream's next batch will tell, and a check not answered yet is no news."""
        if last_seq is None or now - last_at < self._first:
            return False
        if not askable:
            return True
        return last_seq == self._anchor and self.outcome == FAILED
