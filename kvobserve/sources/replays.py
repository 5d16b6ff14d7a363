"""Replay requests of one collector: at most N in flight, the rest queued (part of the stream core).

Gap replays go first: an idle stream's tail check (or an idle publisher's join) waits while a gap
replay is queued and takes at most N - 1 of the slots, so checks against replay ports that do not
answer (each one waits out the timeout) cannot hold up the replay of a gap whose live batches are
being held. Pure: it says which requests to send (`Replay` actions) and which DEALERs to close
(`EndReplay`); the shell opens them.
"""

from __future__ import annotations

from collections import deque

from kvobserve.analysis.actions import CancelReplay, RequestReplay
from kvobserve.sources.ingest_actions import EndReplay, Replay, SocketAction
from kvobserve.sources.stream_state import WatchedStream

DRAIN_LIMIT = 512  # messages taken from one socket per poll round, so no stream starves others


class ReplayQueue:
    """Carries the sequencers' replay requests out as socket actions, within the limits."""

    def __init__(self, max_concurrent: int, out: list[SocketAction]) -> None:
        self._max = max_concurrent
        self._out = out  # the core's outbox
        self._queue: deque[tuple[WatchedStream, RequestReplay]] = deque()  # gap replays
        self._tails: deque[tuple[WatchedStream, RequestReplay]] = deque()  # tail checks, joins
        self._tail_slots = max(1, max_concurrent - 1)
        self._tails_in_flight = 0
        self.in_flight: dict[WatchedStream, tuple[int, bool]] = {}  # -> (replay id, tail)

    def act(self, st: WatchedStream, action: RequestReplay | CancelReplay) -> None:
        """A sequencer's action: end the stream's replay, and ask anew for a RequestReplay."""
        self.end(st)
        if any(s is st for s, _ in self._queue):
            self._queue = deque((s, a) for s, a in self._queue if s is not st)
        if any(s is st for s, _ in self._tails):
            self._tails = deque((s, a) for s, a in self._tails if s is not st)
        if isinstance(action, RequestReplay):
            (self._tails if action.tail else self._queue).append((st, action))
            self.start_queued()

    def start_queued(self) -> None:
        """Send queued requests while fewer than the maximum are in flight (gap replays first)."""
        while len(self.in_flight) < self._max:
            if self._queue:
                st, req = self._queue.popleft()
            elif self._tails and self._tails_in_flight < self._tail_slots:
                st, req = self._tails.popleft()
            else:
                return
            if st.seq is None or st.seq.replay_in_flight != req.replay_id:
                continue  # superseded or timed out while queued
            endpoint = st.spec.replay_endpoint
            if endpoint is None:
                st.seq.on_replay_end(req.replay_id, "error")
                continue
            self.in_flight[st] = (req.replay_id, req.tail)
            self._tails_in_flight += req.tail
            self._out.append(Replay(st, req.replay_id, endpoint, req.start_seq))

    def end(self, st: WatchedStream) -> None:
        """The stream's replay in flight, if any, is over: close its DEALER."""
        got = self.in_flight.pop(st, None)
        if got is not None:
            self._tails_in_flight -= got[1]
            self._out.append(EndReplay(st))

    def forget(self, st: WatchedStream) -> None:
        """A stream no longer watched: its replay ends and nothing of it stays queued."""
        self.end(st)
        self._queue = deque((s, a) for s, a in self._queue if s is not st)
        self._tails = deque((s, a) for s, a in self._tails if s is not st)

    def clear(self) -> None:
        """Forget the queued requests (shutdown)."""
        self._queue.clear()
        self._tails.clear()
