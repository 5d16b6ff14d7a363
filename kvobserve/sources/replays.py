"""Replay requests of one collector: at most N DEALERs in flight, the rest queued (ingest thread)."""

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
        self._queue: deque[tuple[WatchedStream, RequestReplay]] = deque()
        self.by_sock: dict[zmq.Socket[bytes], WatchedStream] = {}

    def act(self, st: WatchedStream, action: RequestReplay | CancelReplay) -> None:
        """A sequencer's action: end the stream's replay, and ask anew for a RequestReplay."""
        self.close(st)
        self._queue = deque((s, a) for s, a in self._queue if s is not st)
        if isinstance(action, RequestReplay):
            self._queue.append((st, action))
            self.start_queued()

    def start_queued(self) -> None:
        """Send queued requests while fewer than the maximum are in flight."""
        while self._queue and len(self.by_sock) < self._max_concurrent:
            st, req = self._queue.popleft()
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
            st.replay = (req.replay_id, sock)
            self.by_sock[sock] = st
            self._poller.register(sock, zmq.POLLIN)

    def drain(self, st: WatchedStream, sock: zmq.Socket[bytes]) -> None:
        """Feed the replies waiting on `sock` to the stream's sequencer."""
        if st.replay is None or st.seq is None:
            return
        replay_id = st.replay[0]
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
                action = st.seq.on_replay_end(replay_id, "ok", self._clock())
                if action is not None:
                    self.act(st, action)
                return
            st.seq.on_replay_batch(replay_id, batch)
            if st.seq.replay_in_flight != replay_id:  # hole filled, or given up
                self.close(st)
                return

    def close(self, st: WatchedStream) -> None:
        """Close the stream's replay socket, if any."""
        if st.replay is None:
            return
        sock = st.replay[1]
        st.replay = None
        self.by_sock.pop(sock, None)
        self._poller.unregister(sock)
        sock.close(linger=0)

    def clear(self) -> None:
        """Forget the queued requests (shutdown)."""
        self._queue.clear()
