"""Bind mode: one endpoint this collector binds, the publishers connected to it, and which stream
each message feeds (part of the stream core; docs/deployment.md "Publishers that connect").

A plain SUB does not say which peer sent a frame; the topic does. Without a template every message
of the endpoint feeds the one stream (worker_id, dp_rank of the port), and two publishers on it
interleave their sequences, which the sequencer reports as a duplicate stream, as in connect mode;
with a template (`kv@{pod}@{model}`, llm-d) each pod is a stream `{worker_id}/{pod}`, found as it
sends. The topic is what llm-d's own scheduler keys central mode on, and routing costs one dict
lookup per message.

Which connection a pod sends on is learned once per route: the shell gives the connection of the
message that opened the route (its socket's file descriptor, libzmq's SRCFD, the same number the
bound SUB's monitor names in ACCEPTED and DISCONNECTED; through the relay process, which reads it
there, with the relay's statuses). A pod whose connection ends is down at once, as a connected
stream whose publisher goes away (its gauges leave /metrics at the next snapshot); its route is
dropped, so its next message, on a new connection, learns that one. A pod whose connection is
not known yet counts as connected while any publisher is. A publisher that reconnects at once is
down for the moment between the two connections, then up again: its sequence tells whether it is
the same process (seq goes on; a gap if frames were lost in between, replayed) or a new one (seq
falls back to 0: a restart).

The bound SUB subscribes to everything (a relay must forward every frame, and a topic that does
not fit is then seen, counted and named instead of filtered out unseen). Pure: the shell binds
(`Bind` action, then `StreamTable.bound`) and reports the socket monitor's events and the relay's
statuses.
"""

from __future__ import annotations

from typing import Any

import zmq

from kvobserve.config.bind import fill_pod
from kvobserve.sources.health import Health
from kvobserve.sources.plan import ListenSpec, StreamSpec
from kvobserve.sources.relay import connection_note
from kvobserve.sources.stream_events import RecentEvents
from kvobserve.sources.stream_state import WatchedStream
from kvobserve.wire.snapshot import BindStats, RelayStats

MAX_ROUTES = 65_536  # topics remembered per endpoint; past it the table starts again
MAX_CLOSED = 4096  # connections remembered as closed (until their descriptor is accepted again)
Key = tuple[str, int]


def listening(endpoint: str) -> str:
    """The reason of a bound endpoint that no publisher is connected to."""
    return f"listening on {endpoint}, no publisher connected"


class Listener:
    """One bound endpoint (one rank of a bind-mode worker)."""

    __slots__ = (
        "bound",
        "closed",
        "conns",
        "health",
        "messages",
        "pending_sources",
        "pods",
        "publishers",
        "relay",
        "relay_health",
        "retry_at",
        "routes",
        "skip_reason",
        "skipped",
        "skips",
        "spec",
        "stream",
        "template",
        "wrong_topics",
    )

    def __init__(self, spec: ListenSpec, events: RecentEvents, wall: float) -> None:
        self.spec = spec
        self.template = spec.template
        name = f"bound endpoint {spec.worker_id} rank {spec.dp_rank} ({spec.endpoint})"
        self.health = Health(name, "starting", f"binding {spec.endpoint}", wall)
        self.bound = False  # the shell has bound it (or its relay lane)
        self.relay: dict[str, Any] | None = None  # relayed: the relay's last status
        self.relay_health: Health | None = None
        self.conns: dict[int, str] = {}  # connections open now: id (fd) -> peer address
        self.closed: dict[int, None] = {}  # connections that ended (insertion-ordered, bounded)
        self.pending_sources: dict[bytes, int] = {}  # relayed: topic -> connection, not routed yet
        self.publishers = 0
        self.routes: dict[bytes, WatchedStream] = {}  # topic frame -> the stream it feeds
        self.skips: dict[bytes, str] = {}  # topic frame -> why no stream takes it
        self.skipped: dict[str, int] = {}
        self.skip_reason = ""
        self.wrong_topics: dict[bytes, int] = {}  # since the last tick (a few kept)
        self.messages = 0
        self.stream: WatchedStream | None = None  # the one stream of a plain topic
        self.pods: set[Key] = set()  # the streams of a template
        self.retry_at: float | None = None  # unbound: when to bind again (None: a bind is asked)

        def changed(h: Health, before: str) -> None:
            msg = f"{before} -> {h.state}: {h.reason}"
            events.add("bind", msg, worker_id=spec.worker_id, dp_rank=spec.dp_rank, at=h.since)

        self.health.on_change = changed
        if spec.relay_to is not None:
            rname = f"relay {spec.worker_id} rank {spec.dp_rank} to {spec.relay_to}"
            self.relay_health = Health(rname, "connecting", f"connecting to {spec.relay_to}", wall)

            def relay_changed(h: Health, before: str) -> None:
                msg = f"relay to {spec.relay_to}: {before} -> {h.state}: {h.reason}"
                events.add("relay", msg, worker_id=spec.worker_id, dp_rank=spec.dp_rank, at=h.since)

            self.relay_health.on_change = relay_changed

    # --- what the shell reports -----------------------------------------------------------------

    def on_bound(self, error: str | None, retry_s: float, now: float, wall: float) -> None:
        """The shell bound the endpoint (`error` None) or could not (why, for a person)."""
        if error is not None:
            self.bound = False
            self.retry_at = now + retry_s
            self._set("bind_failed", error, now, wall)
        elif self.spec.relay_to is None:
            self.bound = True
            self._set("listening", listening(self.spec.endpoint), now, wall)
        else:  # the relay process binds; its statuses say how that goes
            self.bound = True

    def unbound(self, state: str, why: str, now: float, wall: float) -> None:
        """The endpoint is no longer bound (the relay process ended): every pod on it is down,
        and it is bound again at once."""
        self.bound = False
        self.retry_at = now
        self.health.set(state, why, wall)
        if self.relay_health is not None:
            self.relay_health.set("connecting", why, wall)
        for fd in list(self.conns):
            self.closed_conn(fd, now, wall)
        self.publishers = 0
        self._links(now, wall)

    def on_monitor(self, event: int, value: int, peer: str, now: float, wall: float) -> None:
        """One event of the bound SUB's monitor (ACCEPTED and DISCONNECTED name a connection by
        its descriptor, `value`; `peer`: its address, read by the shell when it was accepted)."""
        if event == zmq.EVENT_ACCEPTED:
            self.conns[value] = peer
            self.closed.pop(value, None)
        elif event == zmq.EVENT_DISCONNECTED:
            self.closed_conn(value, now, wall)
        else:
            self.skip_reason = connection_note(event, value) or self.skip_reason
            return
        self._count(now, wall)

    def on_relay_status(self, st: dict[str, Any], now: float, wall: float) -> None:
        """A status of the relay process: the endpoint's state, its connections (with their
        peers) and the connection each topic came on, the relay's own state and counters."""
        self.relay = st["relay"]
        if st["note"]:
            self.skip_reason = st["note"]
        if st["analysis_dropped"]:
            self.skipped["analysis_behind"] = st["analysis_dropped"]
        if self.relay_health is not None:
            r = st["relay"]
            self.relay_health.set(r["state"], r["reason"], r["since"])
        conns = {int(fd): peer for fd, peer in st["conns"].items()}
        for fd in [fd for fd in self.conns if fd not in conns]:
            self.closed_conn(fd, now, wall)
        for fd, peer in conns.items():
            self.conns[fd] = peer
            self.closed.pop(fd, None)
        for topic_hex, fd in st["topics"].items():
            topic = bytes.fromhex(topic_hex)
            pod = self.routes.get(topic)
            if pod is None:
                if len(self.pending_sources) < MAX_ROUTES:
                    self.pending_sources[topic] = fd
            elif pod.source != fd:
                self.learn_source(pod, fd, now, wall)
        self.publishers = len(self.conns)
        if (st["state"], st["reason"]) != (self.health.state, self.health.reason):
            self.health.set(st["state"], st["reason"], st["since"])
        self._links(now, wall)

    def closed_conn(self, fd: int, now: float, wall: float) -> None:
        """Connection `fd` ended: its pods are down, and their next message routes anew."""
        peer = self.conns.pop(fd, "")
        self.closed[fd] = None
        if len(self.closed) > MAX_CLOSED:
            del self.closed[next(iter(self.closed))]
        if not self.template.templated:
            return
        gone = [t for t, pod in self.routes.items() if pod.source == fd]
        for topic in gone:
            pod = self.routes.pop(topic)
            link = pod.link
            if link is not None:
                at = f" ({peer})" if peer else ""
                link.on_gone(f"the publisher's connection{at} to {self.spec.endpoint} ended", wall)

    def learn_source(self, st: WatchedStream, source: int | None, now: float, wall: float) -> None:
        """The connection a pod's messages arrive on (None: the shell cannot tell)."""
        st.source = source
        link = st.link
        if link is not None:
            link.on_publishers(self.pod_publishers(st), now, wall)

    def pod_publishers(self, st: WatchedStream) -> int:
        """1 while the pod's connection is open (or, not known, while any publisher is)."""
        if st.source is None:
            return int(self.publishers > 0)
        return int(st.source not in self.closed)

    def _count(self, now: float, wall: float) -> None:
        n = self.publishers = len(self.conns)
        if n:
            self._set("connected", f"{n} publisher(s) connected to {self.spec.endpoint}", now, wall)
        else:
            self._set("listening", listening(self.spec.endpoint), now, wall)

    def _set(self, state: str, reason: str, now: float, wall: float) -> None:
        self.health.set(state, reason, wall)
        st = self.stream
        if st is not None and st.link is not None and state == "bind_failed":
            st.link.health.set("bind_failed", reason, wall)
        else:
            self._links(now, wall)

    def _links(self, now: float, wall: float) -> None:
        """Tell the endpoint's streams how many publishers they have now."""
        st = self.stream
        if st is not None and st.link is not None:
            st.link.on_publishers(self.publishers, now, wall)
        if not self.template.templated:
            return
        for pod in self.routes.values():
            if pod.link is not None and pod.source is None:
                pod.link.on_publishers(int(self.publishers > 0), now, wall)

    # --- routing ----------------------------------------------------------------------------------

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
        replay = fill_pod(s.replay_endpoint, pod) if s.replay_endpoint else None
        return StreamSpec(f"{s.worker_id}/{pod}", s.dp_rank, s.engine, s.endpoint, topic, replay,
                          bound=True)  # fmt: skip

    # --- snapshot -----------------------------------------------------------------------------

    def stats(self) -> BindStats:
        """The snapshot form of this endpoint."""
        s, h = self.spec, self.health
        relay = None
        if s.relay_to is not None:
            r, rh = self.relay or {}, self.relay_health
            assert rh is not None
            relay = RelayStats(
                s.relay_to, rh.state, rh.reason, rh.since, r.get("forwarded", 0),
                r.get("filtered", 0), {k: v for k, v in r.get("dropped", {}).items() if v},
                r.get("last_drop_time", 0.0), s.relay_queue,
            )  # fmt: skip
        streams = len(self.pods) if self.template.templated else int(self.stream is not None)
        return BindStats(
            s.worker_id, s.dp_rank, s.endpoint, s.topic, h.state, h.reason, h.since,
            self.publishers, self.messages, dict(self.skipped), self.skip_reason, streams, relay,
        )  # fmt: skip
