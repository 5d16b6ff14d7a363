"""Replay requests of one collector: at most N DEALERs in flight, the rest queued (ingest thread).

Gap replays go first: an idle stream's tail check waits while a gap replay is queued and takes at
most N - 1 of the slots, so tail checks against replay ports that do not answer (each one waits
out the timeout) cannot hold up the replay of a gap whose live batches are being held.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import zmq

from kvobserve.analysis.sequence import CancelReplay, RequestReplay
from kvobserve.sources.stream_state import WatchedStream, count_bad
from kvobserve.wire.errors import WireError
from kvobserve.wire.replay import decode_replay_message, encode_replay_request

DRAIN_LIMIT = 512  # messages taken from one socket per poll round, so no stream starves others


class ReplayClient:
    """Sends the sequencers' replay requests and feeds the replies back to them."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        poller: zmq.Poller,
        max_concurrent: int,
        max_payload: int,
        clock: Callable[[], float],
    ) -> None:
        self._ctx, self._poller, self._clock = ctx, poller, clock
        self._max_concurrent, self._max_payload = max_concurrent, max_payload
        self._queue: deque[tuple[WatchedStream, RequestReplay]] = deque()  # gap replays
        self._tails: deque[tuple[WatchedStream, RequestReplay]] = deque()  # tail checks
        self._tail_slots = max(1, max_concurrent - 1)
        self._tails_in_flight = 0
        self.by_sock: dict[zmq.Socket[bytes], WatchedStream] = {}

    def act(self, st: WatchedStream, action: RequestReplay | CancelReplay) -> None:
        """A sequencer's action: end the stream's replay, and ask anew for a RequestReplay."""
        self.close(st)
        self._queue = deque((s, a) for s, a in self._queue if s is not st)
        self._tails = deque((s, a) for s, a in self._tails if s is not st)
        if isinstance(action, RequestReplay):
            (self._tails if action.tail else self._queue).append((st, action))
            self.start_queued()

    def start_queued(self) -> None:
        """Send queued requests while fewer than the maximum are in flight (gap replays first)."""
        while len(self.by_sock) < self._max_concurrent:
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
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)  # a replay may be up to buffer_steps batches at once
            try:
                sock.connect(endpoint)
                sock.send_multipart(encode_replay_request(req.start_seq), zmq.NOBLOCK)
            except zmq.ZMQError:
                sock.close(linger=0)
                st.seq.on_replay_end(req.replay_id, "error")
                continue
            st.replay = (req.replay_id, sock, req.tail)
            self._tails_in_flight += req.tail
            self.by_sock[sock] = st
            self._poller.register(sock, zmq.POLLIN)

    def drain(self, st: WatchedStream, sock: zmq.Socket[bytes]) -> None:
        """Feed the replies waiting on `sock` to the stream's sequencer."""
        if st.replay is None or st.seq is None:
            return
        replay_id, now = st.replay[0], self._clock()
        for _ in range(DRAIN_LIMIT):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                batch = decode_replay_message(frames, st.spec.topic, self._max_payload)
            except WireError as exc:
                count_bad(st, exc.reason, frames[-2] if len(frames) in (3, 4) else b"")
                continue
            if batch is None:  # end marker; holes younger than the reply are asked for anew
                self.close(st)
                again = st.seq.on_replay_end(replay_id, "ok", now)
                if again is not None:
                    self.act(st, again)
                return
            action = st.seq.on_replay_batch(replay_id, batch, frames[-1], now)
            if action is not None:  # a tail check found a restarted publisher
                self.act(st, action)
                return
            if st.seq.replay_in_flight != replay_id:  # hole filled, or given up
                self.close(st)
                return

    def close(self, st: WatchedStream) -> None:
        """Close the stream's replay socket, if any."""
        if st.replay is None:
            return
        _, sock, tail = st.replay
        st.replay = None
        self._tails_in_flight -= tail
        self.by_sock.pop(sock, None)
        self._poller.unregister(sock)
        sock.close(linger=0)

    def clear(self) -> None:
        """Forget the queued requests (shutdown)."""
        self._queue.clear()
        self._tails.clear()
