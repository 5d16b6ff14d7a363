"""Why a KV-event SUB is (not) receiving: its socket monitor's events and what arrives, as a state.

States (docs/collector.md "Stream states"): `starting` (the first connect is under way: not yet
down), `connecting` (no ZMQ connection: refused, no answer, the publisher went away), `not_publisher` (something answers that is not a ZMQ PUB: an HTTP
server, a ROUTER), `undecodable` (a ZMQ publisher whose messages are not KV events),
`wrong_topic` (the publisher sends, but not under the subscribed prefix), `waiting` (connected, no
batch yet), `up`, `idle` (no batch for `idle_s`), `duplicate` (two publishers). A SUB with a
prefix never sees other topics, so a silent connected stream with a topic is checked once per
`reprobe_s` by a short-lived SUB with an empty prefix (the ingest loop opens it, `wants_probe`).
A peer that is not a publisher is not hammered with reconnects (libzmq retries every 100 ms after
a failed handshake, each one a bad request in an HTTP server's log): the ingest loop closes the
socket (`wants_park`) and opens it again after `reopen_s`, doubling up to `reopen_max_s`.
A stream received on an endpoint this collector binds (bind mode, sources/bind.py) is `bound`:
no probe, no park, and `listening` (bound, no publisher connected) or `bind_failed` stand where
a connecting SUB would say `connecting`; the bound SUB takes every topic, so a topic mismatch is
seen directly.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from kvobserve.sources.health import UP_STATES, Health

_HTTP = re.compile(rb"HTTP/1\.[01] \d{3}|\r\n(Server|Content-Length|Content-Type|Date): ", re.I)


def looks_like_http(frames: Sequence[bytes]) -> bool:
    """Whether frames are an HTTP response read as ZMTP 1.0 (what a SUB gets from an HTTP port)."""
    return any(_HTTP.search(f[:512]) for f in frames)


# What the SUBs' monitors report (libzmq's names; see zmq_socket_monitor(3)).
MONITOR_EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_CONNECT_DELAYED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CLOSED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
HTTP_HINT = "not a ZMQ publisher: it answers like an HTTP server (the engine's HTTP port?)"
NOT_PUB = "the ZMQ handshake failed: not a ZMQ PUB (another socket type, or not ZMQ)"


@dataclass(frozen=True, slots=True)
class LinkTimes:
    """How long before a silence or a missing handshake becomes the reason (seconds)."""

    idle_s: float = 10.0  # no batch this long: idle
    handshake_s: float = 5.0  # TCP open this long without a ZMQ handshake: not a publisher
    no_answer_s: float = 5.0  # a connect pending this long: no answer
    probe_after_s: float = 5.0  # connected this long and nothing received: look at the topics
    probe_s: float = 3.0  # how long the empty-prefix SUB listens
    reprobe_s: float = 60.0
    park_after_s: float = 2.0  # not a publisher this long: close the socket (park it)
    reopen_s: float = 10.0  # a parked socket is opened again after this
    reopen_max_s: float = 60.0
    bad_run: int = 5  # undecodable messages in a row (none decoded): undecodable


DEFAULT_LINK_TIMES = LinkTimes()


class Link:
    """The state of one watched endpoint, fed by the ingest thread (monotonic `now`, wall `wall`)."""

    __slots__ = (
        "_attempt_at",
        "_failed",
        "_np_at",
        "_park_s",
        "_probed_at",
        "_reached",
        "_tcp_at",
        "bad_run",
        "bound",
        "endpoint",
        "health",
        "http_like",
        "last_data",
        "parked_at",
        "probing",
        "times",
        "topic",
        "zmq_at",
    )

    def __init__(
        self, endpoint: str, topic: str, health: Health, times: LinkTimes, *, bound: bool = False
    ) -> None:
        self.endpoint, self.topic, self.health, self.times = endpoint, topic, health, times
        self.bound = bound  # bind mode: publishers connect to `endpoint`
        self._attempt_at: float | None = None  # a connect in progress since (no TCP yet)
        self._reached = False  # this attempt reached TCP
        self._failed = False  # this attempt's handshake failed (a reason is set)
        self._tcp_at: float | None = None  # TCP up, handshake pending, since
        self.parked_at: float | None = None  # socket closed (not a publisher) since
        self._park_s = self._np_at = 0.0
        self.zmq_at: float | None = None  # ZMQ handshake done at (None: not connected)
        self._probed_at: float | None = None
        self.last_data: float | None = None  # last decoded batch
        self.bad_run = 0
        self.http_like = False
        self.probing = False

    # --- inputs ---------------------------------------------------------------------------------

    def on_monitor(self, event: int, value: int, now: float, wall: float) -> None:
        """One socket-monitor event."""
        h = self.health
        if event == zmq.EVENT_CONNECT_DELAYED:
            self._attempt_at, self._reached, self._failed = now, False, False
        elif event == zmq.EVENT_CONNECTED:
            self._reached, self._tcp_at, self._attempt_at = True, now, None
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._tcp_at, self.zmq_at, self.bad_run, self.http_like = None, now, 0, False
            self._park_s = 0.0
            if h.state not in ("up", "duplicate"):
                h.set("waiting", "connected, no batch yet", wall)
        elif event in _HANDSHAKE_FAILED:
            self._failed, self._tcp_at = True, None
            self._not_pub(_handshake_reason(event, value, self.http_like), now, wall)
        elif event == zmq.EVENT_DISCONNECTED:
            self._tcp_at = None
            if self.zmq_at is not None:
                self.zmq_at = None
                h.set("connecting", "disconnected: the publisher went away (engine stopped?)", wall)
            elif not self._failed and h.state != "not_publisher":
                self._not_pub(NOT_PUB, now, wall)  # e.g. a ROUTER: libzmq does not retry
        elif event == zmq.EVENT_CONNECT_RETRIED:
            began, self._attempt_at = self._attempt_at, None
            if began is None and (name := unresolved_name(self.endpoint)) is not None:
                # libzmq resolves the name before each attempt: no TCP attempt, no DELAYED
                h.set("connecting", f"cannot resolve {name!r}: no such host", wall)
            elif not self._reached:
                slow = began is not None and now - began >= 1.0
                h.set("connecting", _NO_ANSWER if slow else _REFUSED, wall)

    def on_data(self, good: int, bad: int, bad_reason: str, bad_frames: Sequence[bytes],
                now: float, wall: float) -> None:  # fmt: skip
        """What one drain of the SUB delivered: `good` decoded batches, `bad` undecodable."""
        h = self.health
        if good:
            self.last_data, self.bad_run = now, 0
            if h.state not in ("up", "duplicate"):
                h.set("up", "receiving", wall)
            return
        if not bad:
            return
        self.bad_run += bad
        if not self.http_like and looks_like_http(bad_frames):
            self.http_like = True
        if self.http_like:
            self._not_pub(HTTP_HINT, now, wall)
        elif self.bad_run >= self.times.bad_run:
            h.set("undecodable", f"messages do not decode ({bad_reason}): not KV events?", wall)

    def on_probe(
        self, topics: dict[bytes, int], sample: list[bytes] | None, now: float, wall: float
    ) -> None:
        """What the empty-prefix SUB saw in `probe_s`: message counts by topic frame, and the
        first message (an HTTP answer read as ZMTP 1.0 never passes a prefix filter)."""
        self.probing = False
        h = self.health
        if sample is not None and looks_like_http(sample):
            self.http_like = True
            self._not_pub(HTTP_HINT, now, wall)
            return
        if h.state not in ("waiting", "idle", "wrong_topic"):
            return  # batches arrived meanwhile, or the connection went
        prefix = self.topic.encode()
        if any(t.startswith(prefix) for t in topics):
            return  # the engine has just started publishing under our topic
        if topics:
            seen = ", ".join(repr(t.decode(errors="replace")) for t in sorted(topics)[:3])
            h.set("wrong_topic", f"topic mismatch: subscribed {self.topic!r}, saw {seen}", wall)
        elif h.state == "wrong_topic":
            h.set("waiting", "connected, nothing published (engine idle?)", wall)

    def on_publishers(self, n: int, now: float, wall: float) -> None:
        """Bind mode: `n` publishers are connected to the bound endpoint now."""
        h = self.health
        if n and self.zmq_at is None:
            self.zmq_at = now
            if h.state not in ("up", "duplicate", "idle"):
                h.set("waiting", f"{n} publisher(s) connected, no batch yet", wall)
        elif not n:
            self.zmq_at = None
            gone = "the publisher disconnected (engine stopped?); " if h.state in UP_STATES else ""
            h.set("listening", f"{gone}listening on {self.endpoint}, no publisher connected", wall)

    def on_gone(self, why: str, wall: float) -> None:
        """Bind mode: the connection this stream's publisher sent on ended (a pod went away)."""
        self.zmq_at = None
        self.health.set("listening", f"{why} (engine stopped?)", wall)

    def observe_duplicate(self, duplicate: bool, wall: float) -> None:
        """The sequencer's verdict on a second publisher, at each snapshot."""
        h = self.health
        if duplicate and h.state == "up":
            h.set("duplicate", "two publishers on this stream (interleaved or mirrored)", wall)
        elif not duplicate and h.state == "duplicate":
            h.set("up", "receiving", wall)

    def tick(self, now: float, wall: float) -> None:
        """Time-driven transitions (about once a second)."""
        h, t = self.health, self.times
        tcp, attempt, data = self._tcp_at, self._attempt_at, self.last_data
        if h.state == "up" and data is not None and now - data >= t.idle_s:
            h.set("idle", f"no batch for {t.idle_s:.0f} s or more", wall)
        elif h.state in ("starting", "connecting", "not_publisher") and tcp is not None:
            if now - tcp >= t.handshake_s:
                reason = f"TCP open but no ZMQ handshake in {t.handshake_s:.0f} s: not a ZMQ PUB?"
                self._not_pub(reason, now, wall)
        elif h.state in _CONNECTING and attempt is not None and now - attempt >= t.no_answer_s:
            h.set("connecting", _NO_ANSWER, wall)

    # --- questions of the ingest loop -------------------------------------------------------------

    def wants_probe(self, now: float) -> bool:
        """A topic set, no probe lately, and either connected but silent since connecting (a
        topic mismatch?) or refused by the peer (an HTTP server, whose answer the prefix hides)."""
        t = self.times
        if self.probing or self.bound or not self.topic or self.parked_at is not None:
            return False
        if self._probed_at is not None and now - self._probed_at < t.reprobe_s:
            return False
        if self.health.state == "not_publisher":
            return not self.http_like
        return (
            self.zmq_at is not None
            and now - self.zmq_at >= t.probe_after_s
            and (self.last_data is None or self.last_data < self.zmq_at)
            and self.health.state in ("waiting", "idle", "wrong_topic")
        )

    def probe_started(self, now: float) -> None:
        """The ingest loop opened the empty-prefix SUB."""
        self.probing, self._probed_at = True, now

    def _not_pub(self, reason: str, now: float, wall: float) -> None:
        if self.health.state != "not_publisher":
            self._np_at = now
        self.health.set("not_publisher", reason, wall)

    def wants_park(self, now: float) -> bool:
        """Not a publisher for `park_after_s`: close the socket rather than let libzmq retry
        every 100 ms (the retries until then show what answers, e.g. an HTTP server)."""
        return (
            self.parked_at is None
            and not self.probing
            and self.health.state == "not_publisher"
            and now - self._np_at >= self.times.park_after_s
        )

    def park(self, now: float) -> None:
        """The ingest loop closed the socket; `wants_reopen` says when to open it again."""
        self.parked_at = now
        self._park_s = min(self.times.reopen_max_s, 2 * self._park_s or self.times.reopen_s)
        self._tcp_at = self.zmq_at = self._attempt_at = None
        self._reached = self._failed = False

    def wants_reopen(self, now: float) -> bool:
        """A parked socket's time is up."""
        return self.parked_at is not None and now - self.parked_at >= self._park_s

    def reopened(self) -> None:
        """The socket is open again."""
        self.parked_at = None

    def reason_now(self, now: float) -> str:
        """The reason with its durations as of `now` (what snapshots carry)."""
        h = self.health
        if h.state == "idle" and self.last_data is not None:
            return f"no batch for {now - self.last_data:.0f} s"
        return h.reason


def unresolved_name(target: str) -> str | None:
    """The host name of a tcp:// `target` (None for an address or another transport): what a
    connect that failed before any TCP attempt could not resolve."""
    if not target.startswith("tcp://"):
        return None
    host = target[6:].rpartition(":")[0].strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host or None
    return None


_CONNECTING = frozenset({"starting", "connecting"})
_REFUSED = "connection refused: nothing listens there"
_NO_ANSWER = "no answer: the host is down or the port filtered?"
_HANDSHAKE_FAILED = frozenset(
    {
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
        zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    }
)


def _handshake_reason(event: int, value: int, http_like: bool) -> str:
    if http_like:
        return HTTP_HINT
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"ZMQ authentication failed (status {value})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return f"ZMQ handshake failed (protocol error {value:#x}): not a ZMQ PUB?"
    return NOT_PUB
