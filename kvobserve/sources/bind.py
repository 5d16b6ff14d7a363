"""Bind mode: one endpoint this collector binds, the publishers connected to it, and which stream
each message feeds (owned by the ingest thread; docs/deployment.md "Publishers that connect").

A plain SUB does not say which peer sent a frame. The topic does: without a template every
message of the endpoint feeds the one stream (worker_id, dp_rank of the port), and two publishers
on it interleave their sequences, which the sequencer reports as a duplicate stream, as in connect
mode; with a template (`kv@{pod}@{model}`, llm-d) each pod is a stream `{worker_id}/{pod}`, found
as it sends. ZMQ could say more (the `Peer-Address` property of a received message), but only
for zero-copy frames and only the peer's IP: two engines on one host, or behind one address,
would still be one peer. The topic is what llm-d's own scheduler keys central mode on, and it
costs one dict lookup per message.

The bound SUB subscribes to everything (a relay must forward every frame, and a topic that does
not fit is then seen, counted and named instead of filtered out unseen). Its socket monitor
counts the connections. With `relay_to` the SUB and the downstream socket belong to the relay
thread (sources/relay.py) and the ingest thread reads what it hands over (`inbox`).
"""

from __future__ import annotations

from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvobserve.config.bind import fill_replay
from kvobserve.sources.health import Health
from kvobserve.sources.ingest_options import IngestOptions
from kvobserve.sources.plan import ListenSpec, StreamSpec
from kvobserve.sources.relay import TARGET_EVENTS, Lane, Relay, RelayLink, target_socket
from kvobserve.sources.stream_events import RecentEvents
from kvobserve.sources.stream_state import WatchedStream
from kvobserve.wire.snapshot import BindStats, RelayStats

MAX_ROUTES = 65_536  # topics remembered per endpoint; past it the table starts again
LISTEN_EVENTS = (
    zmq.EVENT_LISTENING
    | zmq.EVENT_BIND_FAILED
    | zmq.EVENT_ACCEPTED
    | zmq.EVENT_ACCEPT_FAILED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
Key = tuple[str, int]


class Listener:
    """One bound endpoint (one rank of a bind-mode worker)."""

    __slots__ = (
        "_inproc",
        "health",
        "inbox",
        "lane",
        "messages",
        "monitor",
        "peers",
        "pods",
        "retry_at",
        "routes",
        "skip_reason",
        "skipped",
        "skips",
        "spec",
        "stream",
        "sub",
        "template",
        "wrong_topics",
    )

    def __init__(self, spec: ListenSpec, events: RecentEvents, wall: float) -> None:
        self.spec = spec
        self.template = spec.template
        name = f"bound endpoint {spec.worker_id} rank {spec.dp_rank} ({spec.endpoint})"
        self.health = Health(name, "starting", f"binding {spec.endpoint}", wall)
        self.sub: zmq.Socket[bytes] | None = None  # the bound SUB (the relay's when relaying)
        self.inbox: zmq.Socket[bytes] | None = None  # what the ingest thread drains
        self.monitor: zmq.Socket[bytes] | None = None
        self.lane: Lane | None = None
        self._inproc = f"inproc://kvobserve-relay-{id(self):x}"
        self.peers: set[int] = set()  # connections open now (their fds)
        self.routes: dict[bytes, WatchedStream] = {}  # topic frame -> the stream it feeds
        self.skips: dict[bytes, str] = {}  # topic frame -> why no stream takes it
        self.skipped: dict[str, int] = {}
        self.skip_reason = ""
        self.wrong_topics: dict[bytes, int] = {}  # since the last tick (a few kept)
        self.messages = 0
        self.stream: WatchedStream | None = None  # the one stream of a plain topic
        self.pods: set[Key] = set()  # the streams of a template
        self.retry_at = 0.0

        def changed(h: Health, before: str) -> None:
            msg = f"{before} -> {h.state}: {h.reason}"
            events.add("bind", msg, worker_id=spec.worker_id, dp_rank=spec.dp_rank, at=h.since)

        self.health.on_change = changed

    # --- sockets (ingest thread) --------------------------------------------------------------

    def open(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        options: IngestOptions,
        relay: Callable[[], Relay],
        events: RecentEvents,
        now: float,
        wall: float,
    ) -> bool:
        """Bind (and start relaying); False when the bind failed (the state says why, and
        the ingest loop tries again after `options.rebind_s`)."""
        rcvhwm = options.rcvhwm
        spec = self.spec
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, rcvhwm)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        mon = sub.get_monitor_socket(LISTEN_EVENTS)
        try:
            sub.bind(spec.endpoint)
        except zmq.ZMQError as exc:
            errno = _bind_errno(mon, exc.errno or 0)
            sub.disable_monitor()
            mon.close(linger=0)
            sub.close(linger=0)
            self.retry_at = now + options.rebind_s
            every = f"{options.rebind_s:g}"
            why = zmq.strerror(errno)
            reason = f"cannot bind {spec.endpoint}: {why}; trying again every {every} s"
            self._set("bind_failed", reason, now, wall)
            return False
        self.sub, self.monitor, self.inbox = sub, mon, sub
        if spec.relay_to is not None:
            self.inbox = self._relay(ctx, sub, rcvhwm, relay(), events, wall)
        self._set("listening", f"listening on {spec.endpoint}, no publisher connected", now, wall)
        return True

    def _relay(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        sub: zmq.Socket[bytes],
        rcvhwm: int,
        relay: Relay,
        events: RecentEvents,
        wall: float,
    ) -> zmq.Socket[bytes]:
        """Hand the bound SUB to the relay thread with its target socket; the inbox to drain."""
        spec = self.spec
        assert spec.relay_to is not None
        name = f"relay {spec.worker_id} rank {spec.dp_rank} to {spec.relay_to}"
        health = Health(name, "connecting", f"connecting to {spec.relay_to}", wall)

        def changed(h: Health, before: str) -> None:
            msg = f"relay to {spec.relay_to}: {before} -> {h.state}: {h.reason}"
            events.add("relay", msg, worker_id=spec.worker_id, dp_rank=spec.dp_rank, at=h.since)

        health.on_change = changed
        link = RelayLink(spec.relay_to, spec.relay_queue, health)
        xpub = target_socket(ctx, link)
        xmon = xpub.get_monitor_socket(TARGET_EVENTS)
        xpub.connect(spec.relay_to)
        inbox = ctx.socket(zmq.PULL)
        inbox.setsockopt(zmq.LINGER, 0)
        inbox.setsockopt(zmq.RCVHWM, rcvhwm)
        inbox.bind(self._inproc)
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDHWM, rcvhwm)
        push.connect(self._inproc)
        self.lane = Lane(sub, xpub, xmon, push, link)
        relay.adopt(self.lane)
        return inbox

    def close(self, relay: Relay | None) -> None:
        """Close every socket (the relay's in its thread); the streams are the caller's."""
        if self.lane is not None and relay is not None:
            relay.close(self.lane)
        elif self.sub is not None:
            self.sub.disable_monitor()
            self.sub.close(linger=0)
        for sock in (self.monitor, self.inbox):
            if sock is not None and not sock.closed:
                sock.close(linger=0)
        self.sub = self.inbox = self.monitor = self.lane = None
        self.peers.clear()

    # --- inputs -------------------------------------------------------------------------------

    def on_monitor(self, event: int, value: int, now: float, wall: float) -> None:
        """One event of the bound SUB's monitor (values of ACCEPTED/DISCONNECTED are fds)."""
        if event == zmq.EVENT_ACCEPTED:
            self.peers.add(value)
        elif event == zmq.EVENT_DISCONNECTED:
            self.peers.discard(value)
        elif event in (zmq.EVENT_LISTENING, zmq.EVENT_BIND_FAILED):
            return
        elif event == zmq.EVENT_ACCEPT_FAILED:
            self.skip_reason = f"a connection could not be accepted (errno {value})"
            return
        else:  # a failed handshake: something connected that is not a ZMQ publisher
            self.skip_reason = "a peer failed the ZMQ handshake: not a ZMQ PUB?"
            return
        n = len(self.peers)
        if n:
            self._set("connected", f"{n} publisher(s) connected to {self.spec.endpoint}", now, wall)
        else:
            reason = f"listening on {self.spec.endpoint}, no publisher connected"
            self._set("listening", reason, now, wall)

    def _set(self, state: str, reason: str, now: float, wall: float) -> None:
        self.health.set(state, reason, wall)
        st = self.stream
        if st is not None and st.link is not None:
            link = st.link
            if state == "bind_failed":
                link.health.set("bind_failed", reason, wall)
            else:
                link.on_publishers(len(self.peers), now, wall)

    def skip(self, topic: bytes, reason: str, text: str) -> None:
        """Remember that messages of `topic` feed no stream, and why."""
        if len(self.skips) >= MAX_ROUTES:
            self.skips.clear()
        self.skips[topic] = reason
        self.skip_reason = text
        if reason == "topic_mismatch" and len(self.wrong_topics) < 3:
            self.wrong_topics[topic] = 1

    def route(self, topic: bytes, st: WatchedStream) -> None:
        """Messages of `topic` feed `st` from now on."""
        if len(self.routes) >= MAX_ROUTES:
            self.routes.clear()
        self.routes[topic] = st

    def forget_routes(self) -> None:
        """Look every topic up again (a stream went, or the cap may let a new one in)."""
        self.routes.clear()
        self.skips.clear()

    def pod_spec(self, topic: str) -> StreamSpec | str:
        """The stream a topic names, or why it names none (with a template)."""
        fields = self.template.match(topic)
        if fields is None:
            return f"topic {topic!r} does not fit {self.spec.topic!r}"
        s = self.spec
        pod = fields["pod"]
        replay = fill_replay(s.replay_endpoint, pod) if s.replay_endpoint else None
        return StreamSpec(f"{s.worker_id}/{pod}", s.dp_rank, s.engine, s.endpoint, topic, replay,
                          bound=True)  # fmt: skip

    # --- snapshot -----------------------------------------------------------------------------

    def stats(self) -> BindStats:
        """The snapshot form of this endpoint (read in the ingest thread)."""
        s, h = self.spec, self.health
        relay = None
        if self.lane is not None:
            link, rh = self.lane.link, self.lane.link.health
            relay = RelayStats(
                link.target, rh.state, rh.reason, rh.since, link.forwarded, link.filtered,
                {k: v for k, v in link.dropped.items() if v}, link.last_drop_time, link.queue,
            )  # fmt: skip
            if link.analysis_dropped:
                self.skipped["analysis_behind"] = link.analysis_dropped
        streams = len(self.pods) if self.template.templated else int(self.stream is not None)
        return BindStats(
            s.worker_id, s.dp_rank, s.endpoint, s.topic, h.state, h.reason, h.since,
            len(self.peers), self.messages, dict(self.skipped), self.skip_reason, streams, relay,
        )  # fmt: skip


def _bind_errno(mon: zmq.Socket[bytes], errno: int) -> int:
    """Why a bind failed: libzmq's BIND_FAILED monitor event has the errno, which its own
    sending of that event can overwrite (EAGAIN) before zmq_bind returns."""
    if mon.poll(0):
        msg = parse_monitor_message(mon.recv_multipart())
        if int(msg["event"]) == zmq.EVENT_BIND_FAILED:
            return int(msg["value"])
    return errno
