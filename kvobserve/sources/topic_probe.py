"""Short-lived SUBs with an empty prefix: which topics does a silent publisher send under?

A SUB with a prefix filter never receives (or counts) messages under other topics, so a topic
mismatch looks exactly like an idle engine. When a connected stream with a topic has received
nothing for a while, its Link asks for a probe (`wants_probe`); the probe listens `probe_s`,
counts messages by their first frame (at most 16 distinct) and hands the counts to the Link.
A stream whose peer fails the ZMQ handshake is probed too: an HTTP server's answer, which libzmq
delivers as ZMTP 1.0 frames, never passes the stream's prefix filter but shows here. Part of the
stream core: pure, the shell opens and closes the SUBs (`Probe`, `EndProbe`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvobserve.sources.ingest_actions import EndProbe, Probe, SocketAction
from kvobserve.sources.stream_state import WatchedStream

_MAX_TOPICS = 16
MAX_MESSAGES = 1000  # taken from one probe per poll round


@dataclass(slots=True)
class _Probe:
    deadline: float
    topics: dict[bytes, int] = field(default_factory=dict)
    sample: list[bytes] | None = None  # its first message (an HTTP answer shows here)


class TopicProbes:
    """The probes in flight of one stream core."""

    def __init__(self, out: list[SocketAction]) -> None:
        self._out = out
        self._probes: dict[WatchedStream, _Probe] = {}
        self.opened_total = 0

    def open(self, st: WatchedStream, now: float) -> None:
        """Listen on the stream's endpoint with an empty prefix for `probe_s`."""
        link = st.link
        assert link is not None
        link.probe_started(now)
        self._probes[st] = _Probe(now + link.times.probe_s)
        self.opened_total += 1
        self._out.append(Probe(st))

    def failed(self, st: WatchedStream) -> None:
        """The probe could not be opened (a bad endpoint): nothing to listen to."""
        if self._probes.pop(st, None) is not None and st.link is not None:
            st.link.probing = False

    def on_message(self, st: WatchedStream, frames: Sequence[bytes]) -> None:
        """One message the probe received: counted by its topic frame."""
        p = self._probes.get(st)
        if p is None:
            return
        if p.sample is None:
            p.sample = [f[:512] for f in frames[:4]]
        topic = frames[0][:64] if len(frames) > 1 else b""
        topics = p.topics
        if topic in topics or len(topics) < _MAX_TOPICS:
            topics[topic] = topics.get(topic, 0) + 1

    def expire(self, now: float, wall: float) -> None:
        """End the probes whose time is up and tell each Link what its probe saw."""
        for st, p in list(self._probes.items()):
            if now >= p.deadline:
                del self._probes[st]
                self._out.append(EndProbe(st))
                if st.link is not None:
                    st.link.on_probe(p.topics, p.sample, now, wall)

    def close_for(self, keep: Callable[[WatchedStream], bool]) -> None:
        """End the probes of streams `keep` rejects (the stream went away)."""
        for st in [s for s in self._probes if not keep(s)]:
            del self._probes[st]
            self._out.append(EndProbe(st))
            if st.link is not None:
                st.link.probing = False

    def close_all(self) -> None:
        """End every probe (shutdown)."""
        self.close_for(lambda _: False)
