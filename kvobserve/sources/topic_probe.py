"""Short-lived SUBs with an empty prefix: which topics does a silent publisher send under?

A SUB with a prefix filter never receives (or counts) messages under other topics, so a topic
mismatch looks exactly like an idle engine. When a connected stream with a topic has received
nothing for a while, the ingest loop asks `TopicProbes.open`; the probe listens `probe_s`, counts
messages by their first frame (at most 16 distinct) and hands the counts to the stream's Link.
A stream whose peer fails the ZMQ handshake is probed too: an HTTP server's answer, which libzmq
delivers as ZMTP 1.0 frames, never passes the stream's prefix filter but shows here.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

from kvobserve.sources.link import Link

_MAX_TOPICS = 16


class TopicProbes:
    """The probes in flight of one ingest loop; their sockets sit in the loop's poller."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], poller: zmq.Poller) -> None:
        self._ctx, self._poller = ctx, poller
        self.by_sock: dict[zmq.Socket[bytes], tuple[Link, float, dict[bytes, int]]] = {}
        self._sample: dict[zmq.Socket[bytes], list[bytes]] = {}  # each probe's first message
        self.opened_total = 0

    def open(self, link: Link, now: float) -> None:
        """Listen on `link`'s endpoint with an empty prefix for `probe_s`."""
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1000)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            sock.connect(link.endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)
            return
        link.probe_started(now)
        self.by_sock[sock] = (link, now + link.times.probe_s, {})
        self._poller.register(sock, zmq.POLLIN)
        self.opened_total += 1

    def drain(self, sock: zmq.Socket[bytes]) -> None:
        """Count what arrived, by topic frame."""
        _, _, topics = self.by_sock[sock]
        for _ in range(1000):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._sample.setdefault(sock, [f[:512] for f in frames[:4]])
            topic = frames[0][:64] if len(frames) > 1 else b""
            if topic in topics or len(topics) < _MAX_TOPICS:
                topics[topic] = topics.get(topic, 0) + 1

    def expire(self, now: float, wall: float) -> None:
        """Close the probes whose time is up and report what each saw."""
        for sock, (link, deadline, topics) in list(self.by_sock.items()):
            if now >= deadline:
                sample = self._sample.get(sock)
                self._close(sock)
                link.on_probe(topics, sample, now, wall)

    def close_for(self, keep: Callable[[Link], bool]) -> None:
        """Close the probes whose link `keep` rejects (the stream went away)."""
        for sock, (link, _, _) in list(self.by_sock.items()):
            if not keep(link):
                self._close(sock)
                link.probing = False

    def close_all(self) -> None:
        """Close every probe (shutdown)."""
        for sock in list(self.by_sock):
            self._close(sock)

    def _close(self, sock: zmq.Socket[bytes]) -> None:
        del self.by_sock[sock]
        self._sample.pop(sock, None)
        self._poller.unregister(sock)
        sock.close(linger=0)
