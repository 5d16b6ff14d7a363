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
counts the connections. With `relay_to` the relay process binds it (sources/relay.py), and the
ingest thread reads what the relay hands over (`inbox`) and learns the rest from its statuses.
"""

from __future__ import annotations

from typing import Any

import zmq

from kvobserve.config.bind import fill_replay
from kvobserve.sources.health import Health
from kvobserve.sources.ingest_options import IngestOptions
from kvobserve.sources.plan import ListenSpec, StreamSpec
from kvobserve.sources.relay import Relay, bind_endpoint, count_peers
from kvobserve.sources.stream_events import RecentEvents
from kvobserve.sources.stream_state import WatchedStream
from kvobserve.wire.snapshot import BindStats, RelayStats

MAX_ROUTES = 65_536  # topics remembered per endpoint; past it the table starts again
Key = tuple[str, int]


class Listener:
    """One bound endpoint (one rank of a bind-mode worker)."""

    __slots__ = (
        "health",
        "inbox",
        "lane",
        "messages",
        "monitor",
        "peers",
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
        self.inbox: zmq.Socket[bytes] | None = None  # what the ingest thread drains
        self.monitor: zmq.Socket[bytes] | None = None  # the bound SUB's (not when relayed)
        self.lane: int | None = None  # relayed: the relay process's lane
        self.relay: dict[str, Any] | None = None  # relayed: the relay's last status
        self.relay_health: Health | None = None
        self.peers: set[int] = set()  # connections open now (their fds; not when relayed)
        self.publishers = 0
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
        if spec.relay_to is not None:
            rname = f"relay {spec.worker_id} rank {spec.dp_rank} to {spec.relay_to}"
            self.relay_health = Health(rname, "connecting", f"connecting to {spec.relay_to}", wall)

            def relay_changed(h: Health, before: str) -> None:
                msg = f"relay to {spec.relay_to}: {before} -> {h.state}: {h.reason}"
                events.add("relay", msg, worker_id=spec.worker_id, dp_rank=spec.dp_rank, at=h.since)

            self.relay_health.on_change = relay_changed

    # --- sockets (ingest thread) --------------------------------------------------------------

    def open(
        self, ctx: zmq.Context[zmq.Socket[bytes]], options: IngestOptions, now: float, wall: float
    ) -> bool:
        """Bind; False when the bind failed (the state says why; the ingest loop tries again
        after `options.rebind_s`)."""
        spec = self.spec
        bound = bind_endpoint(ctx, spec.endpoint, options.rcvhwm, options.rebind_s)
        if isinstance(bound, str):
            self.retry_at = now + options.rebind_s
            self._set("bind_failed", bound, now, wall)
            return False
        self.inbox, self.monitor = bound
        self._set("listening", f"listening on {spec.endpoint}, no publisher connected", now, wall)
        return True

    def open_relayed(
        self, ctx: zmq.Context[zmq.Socket[bytes]], options: IngestOptions, relay: Relay
    ) -> None:
        """Have the relay process bind and forward; the ingest thread reads what it hands over
        (its state arrives with the relay's statuses)."""
        spec = self.spec
        assert spec.relay_to is not None
        lane, handoff = relay.handoff_endpoint()
        inbox = ctx.socket(zmq.PULL)
        inbox.setsockopt(zmq.LINGER, 0)
        inbox.setsockopt(zmq.RCVHWM, options.rcvhwm)
        inbox.bind(handoff)
        handoff = inbox.getsockopt_string(zmq.LAST_ENDPOINT)  # the port, on loopback TCP
        self.inbox, self.lane = inbox, lane
        relay.open(lane, spec.endpoint, spec.relay_to, spec.relay_queue, handoff,
                   options.rcvhwm, options.rebind_s, options.relay_wait_s)  # fmt: skip

    def close(self, relay: Relay | None) -> None:
        """Close every socket (and the relay's lane); the streams are the caller's."""
        if self.lane is not None and relay is not None:
            relay.close(self.lane)
        if self.monitor is not None and self.inbox is not None:
            self.inbox.disable_monitor()
        for sock in (self.monitor, self.inbox):
            if sock is not None and not sock.closed:
                sock.close(linger=0)
        self.inbox = self.monitor = None
        self.lane = None
        self.peers.clear()
        self.publishers = 0

    # --- inputs -------------------------------------------------------------------------------

    def on_monitor(self, event: int, value: int, now: float, wall: float) -> None:
        """One event of the bound SUB's monitor (values of ACCEPTED/DISCONNECTED are fds)."""
        note = count_peers(self.peers, event, value)
        if note is not None:
            self.skip_reason = note
            return
        self.publishers = n = len(self.peers)
        if n:
            self._set("connected", f"{n} publisher(s) connected to {self.spec.endpoint}", now, wall)
        else:
            reason = f"listening on {self.spec.endpoint}, no publisher connected"
            self._set("listening", reason, now, wall)

    def on_relay_status(self, st: dict[str, Any], now: float, wall: float) -> None:
        """A status of the relay process: the endpoint's state, its connections, the relay's."""
        self.relay = st["relay"]
        self.publishers = st["publishers"]
        if st["note"]:
            self.skip_reason = st["note"]
        if st["analysis_dropped"]:
            self.skipped["analysis_behind"] = st["analysis_dropped"]
        if self.relay_health is not None:
            r = st["relay"]
            self.relay_health.set(r["state"], r["reason"], r["since"])
        if (st["state"], st["reason"]) != (self.health.state, self.health.reason):
            self._set(st["state"], st["reason"], now, st["since"])

    def _set(self, state: str, reason: str, now: float, wall: float) -> None:
        self.health.set(state, reason, wall)
        st = self.stream
        if st is not None and st.link is not None:
            link = st.link
            if state == "bind_failed":
                link.health.set("bind_failed", reason, wall)
            else:
                link.on_publishers(self.publishers, now, wall)

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
