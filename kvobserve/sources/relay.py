"""The relay of bind mode: every frame of a bound endpoint forwarded unchanged downstream, first.

llm-d's scheduler binds `tcp://*:5556` and the engines connect to it; kvobserve binds that port
instead and forwards to the scheduler (`relay_to`), which binds elsewhere. The relay runs in a
process of its own (`relay_main`), so no analysis, garbage collection or snapshot of the
collector ever holds a frame back: as a thread it waited for the interpreter lock behind the
analysis (unpaced through the full analysis, 21,600 frames/s as a thread, 50-61,000 as a
process on the same machine: benchmarks/relay.py). For each relayed endpoint it binds the SUB, reads each
frame, sends it to the target and only then hands it to the collector's ingest thread over an
ipc PUSH; when the ingest thread is behind, that queue fills and frames are skipped there
(counted, `analysis_behind`; the stream sees a gap and asks for a replay).

Toward the target the bounded queue is an XPUB's high-water mark (`relay_queue` frames, with
XPUB_NODROP so that a full queue refuses instead of dropping silently) that connects to the
target's bound SUB. IMMEDIATE: nothing queues for a target that is not connected, and its
subscription ends with its connection, so every frame is counted once: forwarded, filtered (the
target did not subscribe to its topic) or dropped (`no_target`: nobody subscribes; `queue_full`).

`Relay` is the collector's side (owned by its ingest thread): it starts the process, sends it
`open`/`close` commands over a PAIR and reads back each endpoint's state and counters (on every
change and every STATUS_S). The process ends with a `stop`, by its PID, or when its parent is
gone.
"""

from __future__ import annotations

import contextlib
import errno as os_errno
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvobserve.sources.link import unresolved_name
from kvobserve.wire.snapshot import RELAY_DROP_REASONS

log = logging.getLogger(__name__)

DRAIN_LIMIT = 512  # frames taken from one bound SUB per poll round
POLL_MS = 100
STATUS_S = 0.25  # counters reach the collector this often (state changes at once)
_NUMBERS = itertools.count(1)  # names each Relay's endpoints (see Relay.__init__)
# plain ints: pyzmq's flag enums cost more than the send itself when combined per frame
_RCVMORE, _EVENTS, _POLLIN = int(zmq.RCVMORE), int(zmq.EVENTS), int(zmq.POLLIN)
_NOBLOCK, _SNDMORE, _SRCFD = int(zmq.NOBLOCK), int(zmq.SNDMORE), int(zmq.SRCFD)
MAX_TOPICS = 65_536  # topics whose connection a lane remembers (as sources/bind.py's routes)
TOPICS_EVERY_S = 5.0  # the topic table goes out at least this often (a status may be refused)
TARGET_EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_CONNECT_DELAYED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
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


# --- shared by the relay process and the ingest thread -------------------------------------------


def bound_sub(ctx: zmq.Context[zmq.Socket[bytes]], rcvhwm: int) -> zmq.Socket[bytes]:
    """The SUB of a bound endpoint: every topic (a relay forwards all; a wrong one is seen)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, rcvhwm)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    return sub


def bind_endpoint(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, rcvhwm: int, retry_s: float | None
) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]] | str:
    """The SUB bound at `endpoint` with its monitor (connections), or why it could not be bound,
    for a person (and that it is tried again after `retry_s`, when given). libzmq's BIND_FAILED
    monitor event has the errno, which its own sending of that event can overwrite (EAGAIN)
    before zmq_bind returns."""
    sub = bound_sub(ctx, rcvhwm)
    mon = sub.get_monitor_socket(LISTEN_EVENTS)
    try:
        sub.bind(endpoint)
    except zmq.ZMQError as exc:
        errno = exc.errno or 0
        if mon.poll(0):
            msg = parse_monitor_message(mon.recv_multipart())
            if int(msg["event"]) == zmq.EVENT_BIND_FAILED:
                errno = int(msg["value"])
        sub.disable_monitor()
        mon.close(linger=0)
        sub.close(linger=0)
        why = f"cannot bind {endpoint}: {zmq.strerror(errno)}{_bind_hint(endpoint, errno)}"
        return why if retry_s is None else f"{why}; trying again every {retry_s:g} s"
    return sub, mon


def _bind_hint(endpoint: str, errno: int) -> str:
    """What an operator does about a bind that failed with `errno`."""
    if errno == os_errno.EADDRINUSE:
        return (
            " (another process binds that port: a second kvobserve, or the scheduler, which "
            "cannot share it; relay_to puts kvobserve in front of it)"
        )
    if errno in (os_errno.EADDRNOTAVAIL, os_errno.ENODEV):
        host, _, port = endpoint.partition("://")[2].rpartition(":")
        return f" ({host} is not an address of this machine: bind tcp://*:{port} instead)"
    return ""


def nobody_connected(endpoint: str, within: str = "") -> str:
    """Why a bound endpoint is silent when no publisher connected (`within`: " in 3 s")."""
    port = endpoint.rpartition(":")[2]
    return (
        f"no publisher connected{within} (the engines' --kv-events-config endpoint must name "
        f"this host, port {port})"
    )


def peer_of(fd: int) -> str:
    """The address of the peer of an accepted connection (the descriptor a monitor's ACCEPTED
    names, in this process), "" when it cannot be read (already closed)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            host, port = s.getpeername()[:2]
    except (OSError, ValueError):
        return ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def connection_note(event: int, value: int) -> str | None:
    """What a bound endpoint's monitor event says about a connection that failed (None: it
    opened or ended one, or it is about the endpoint itself)."""
    if event == zmq.EVENT_ACCEPT_FAILED:
        return f"a connection could not be accepted (errno {value})"
    if event not in (
        zmq.EVENT_LISTENING, zmq.EVENT_BIND_FAILED, zmq.EVENT_ACCEPTED, zmq.EVENT_DISCONNECTED,
    ):  # fmt: skip
        return "a peer failed the ZMQ handshake: not a ZMQ PUB?"
    return None


def count_peers(peers: set[int], event: int, value: int) -> str | None:
    """Track the connections of a bound endpoint (ACCEPTED/DISCONNECTED carry the fd); None, or
    a note on a connection that failed."""
    if event == zmq.EVENT_ACCEPTED:
        peers.add(value)
    elif event == zmq.EVENT_DISCONNECTED:
        peers.discard(value)
    return connection_note(event, value)


# --- the relay process -------------------------------------------------------------------------


class RelayLink:
    """One relay target: whether frames reach it, and the counts (in the relay process)."""

    __slots__ = (
        "_attempt_at",
        "connected",
        "dropped",
        "filtered",
        "forwarded",
        "last_drop_time",
        "reason",
        "since",
        "state",
        "subs",
        "target",
    )

    def __init__(self, target: str, wall: float) -> None:
        self.target = target
        self.state, self.reason, self.since = "connecting", f"connecting to {target}", wall
        self.subs: tuple[bytes, ...] = ()  # the prefixes the target subscribes to
        self.connected = False
        self.forwarded = self.filtered = 0
        self.dropped = dict.fromkeys(RELAY_DROP_REASONS, 0)
        self.last_drop_time = 0.0  # wall clock; 0: never
        self._attempt_at: float | None = None

    def _set(self, state: str, reason: str, wall: float) -> None:
        if state != self.state:
            self.since = wall
        self.state, self.reason = state, reason

    def on_monitor(self, event: int, now: float, wall: float) -> None:
        """One event of the target socket's monitor."""
        where = self.target
        if event == zmq.EVENT_CONNECT_DELAYED:
            if self._attempt_at is None:
                self._attempt_at = now
        elif event == zmq.EVENT_CONNECT_RETRIED:
            began, self._attempt_at = self._attempt_at, None
            slow = began is not None and now - began >= 1.0
            if began is None and (name := unresolved_name(where)) is not None:
                # libzmq resolves the name before each attempt: no TCP attempt, no DELAYED
                self._set("connecting", f"cannot resolve {name!r} in {where}: no such host", wall)
            elif slow:
                self._set(
                    "connecting", f"no answer from {where}: the host is down or filtered?", wall
                )
            else:
                self._set("connecting", f"connection refused: nothing listens at {where}", wall)
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected, self._attempt_at = True, None
            self._update(wall)
        elif event == zmq.EVENT_DISCONNECTED:
            if self.connected:
                self._set("connecting", f"disconnected: {where} went away (restarted?)", wall)
            self.connected = False
        elif event != zmq.EVENT_CONNECTED:  # a failed handshake
            self._set(
                "not_subscriber", f"the ZMQ handshake with {where} failed: not a ZMQ SUB?", wall
            )

    def on_subscription(self, msg: bytes, wall: float) -> None:
        """A (un)subscription message of the target (first byte 1 or 0, then the prefix)."""
        if not msg:
            return
        subs = set(self.subs)
        if msg[0] == 1:
            subs.add(msg[1:])
        elif msg[0] == 0:
            subs.discard(msg[1:])
        self.subs = tuple(sorted(subs))
        self._update(wall)

    def _update(self, wall: float) -> None:
        if self.connected and self.subs:
            shown = ", ".join(repr(s.decode(errors="replace")) for s in self.subs)
            self._set("up", f"forwarding to {self.target} (it subscribes to {shown})", wall)
        elif self.connected:
            self._set("waiting", f"connected to {self.target}; it has not subscribed yet", wall)

    def drop(self, reason: str, wall: float) -> None:
        """One frame not forwarded."""
        self.dropped[reason] += 1
        self.last_drop_time = wall

    @property
    def up(self) -> bool:
        """Connected and subscribed: frames reach the target."""
        return self.connected and bool(self.subs)


class _Lane:
    """One relayed endpoint in the relay process: bound SUB in, target XPUB out, ipc PUSH to
    the collector."""

    def __init__(self, cmd: dict[str, Any], wall: float) -> None:
        self.id: int = cmd["lane"]
        self.endpoint: str = cmd["endpoint"]
        self.handoff: str = cmd["handoff"]
        self.rcvhwm: int = cmd["rcvhwm"]
        self.rebind_s: float = cmd["rebind_s"]
        self.wait_s: float = cmd["wait_s"]  # bind once the target subscribed, or after this
        self.queue: int = cmd["queue"]
        self.link = RelayLink(cmd["target"], wall)
        self.state, self.reason, self.since = "starting", f"binding {self.endpoint}", wall
        self.dirty = True  # a state changed: the collector hears at once, not at the next tick
        self.note = ""
        self.conns: dict[int, str] = {}  # connections open now: fd -> peer address
        self.topics: dict[bytes, int] = {}  # topic -> the connection its first message came on
        self.topics_sent_at = 0.0  # the full topic table goes out when it changed, and now and then
        self.topics_dirty = False
        self.analysis_dropped = 0
        self.retry_at = 0.0
        self.sub: zmq.Socket[bytes] | None = None
        self.smon: zmq.Socket[bytes] | None = None
        self.xpub: zmq.Socket[bytes] | None = None
        self.xmon: zmq.Socket[bytes] | None = None
        self.push: zmq.Socket[bytes] | None = None

    def set(self, state: str, reason: str, wall: float) -> None:
        if state != self.state:
            self.since = wall
        self.state, self.reason, self.dirty = state, reason, True

    def open_target(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        """The XPUB to the target (bounded, refusing when full, no queue before the target is
        connected) and the PUSH to the collector."""
        x = self.xpub = ctx.socket(zmq.XPUB)
        x.setsockopt(zmq.LINGER, 0)
        x.setsockopt(zmq.SNDHWM, self.queue)
        x.setsockopt(zmq.XPUB_NODROP, 1)
        x.setsockopt(zmq.IMMEDIATE, 1)
        x.setsockopt(zmq.RECONNECT_IVL, 100)
        x.setsockopt(zmq.RECONNECT_IVL_MAX, 5_000)
        self.xmon = x.get_monitor_socket(TARGET_EVENTS)
        x.connect(self.link.target)
        p = self.push = ctx.socket(zmq.PUSH)
        p.setsockopt(zmq.LINGER, 0)
        p.setsockopt(zmq.SNDHWM, self.rcvhwm)
        p.connect(self.handoff)

    def bind(self, ctx: zmq.Context[zmq.Socket[bytes]], now: float, wall: float) -> bool:
        """Bind the endpoint; False (and a retry time) when it is taken."""
        bound = bind_endpoint(ctx, self.endpoint, self.rcvhwm, self.rebind_s)
        if isinstance(bound, str):
            self.retry_at = now + self.rebind_s
            self.set("bind_failed", bound, wall)
            return False
        self.sub, self.smon = bound
        self.set("listening", f"listening on {self.endpoint}, no publisher connected", wall)
        return True

    def on_listen_monitor(self, event: int, value: int, wall: float) -> None:
        if event == zmq.EVENT_ACCEPTED:
            self.conns[value] = peer_of(value)
        elif event == zmq.EVENT_DISCONNECTED:
            self.conns.pop(value, None)
            gone = [t for t, fd in self.topics.items() if fd == value]
            for t in gone:  # their next message, on a new connection, names it
                del self.topics[t]
            self.topics_dirty = self.topics_dirty or bool(gone)
        else:
            self.note = connection_note(event, value) or self.note
            return
        if (n := len(self.conns)) > 0:
            self.set("connected", f"{n} publisher(s) connected to {self.endpoint}", wall)
        elif self.state == "connected":
            self.set("listening", f"listening on {self.endpoint}, no publisher connected", wall)

    def sockets(self) -> list[tuple[zmq.Socket[bytes], str]]:
        roles = ((self.sub, "sub"), (self.smon, "smon"), (self.xpub, "xpub"), (self.xmon, "xmon"))
        return [(s, role) for s, role in roles if s is not None]

    def close(self) -> None:
        for s in (self.sub, self.xpub):
            if s is not None:
                s.disable_monitor()
        for s in (self.sub, self.smon, self.xpub, self.xmon, self.push):
            if s is not None:
                s.close(linger=0)
        self.sub = self.smon = self.xpub = self.xmon = self.push = None

    def status(self, topics: bool) -> dict[str, Any]:
        """This lane's status for the collector (`topics`: with the topic table)."""
        k = self.link
        return {
            "lane": self.id, "state": self.state, "reason": self.reason, "since": self.since,
            "publishers": len(self.conns), "note": self.note,
            "conns": {str(fd): peer for fd, peer in self.conns.items()},
            "topics": {t.hex(): fd for t, fd in self.topics.items()} if topics else {},
            "analysis_dropped": self.analysis_dropped,
            "relay": {
                "state": k.state, "reason": k.reason, "since": k.since, "forwarded": k.forwarded,
                "filtered": k.filtered, "dropped": dict(k.dropped),
                "last_drop_time": k.last_drop_time,
            },
        }  # fmt: skip

    def forward(self, wall: Callable[[], float]) -> None:
        """Forward what waits on the bound SUB, then hand it to the collector."""
        sub, xpub, push, link = self.sub, self.xpub, self.push, self.link
        assert sub is not None and xpub is not None and push is not None
        recv, more, events = sub.recv, sub.get, xpub.get
        send, hand, topics = xpub.send, push.send, self.topics
        for _ in range(DRAIN_LIMIT):
            try:
                first = recv(_NOBLOCK, copy=False)
            except zmq.Again:
                break
            frames = [first.bytes]
            if frames[0] not in topics and len(topics) < MAX_TOPICS:
                topics[frames[0]] = first.get(_SRCFD)  # which pod's connection: the collector
                self.topics_dirty = True  # tells a pod that goes away by it (sources/bind.py)
            while more(_RCVMORE):
                frames.append(recv(_NOBLOCK))
            if int(events(_EVENTS)) & _POLLIN:
                # the target's (un)subscription first: a send after its connection ended is
                # dropped by the XPUB without a word (reading EVENTS also makes libzmq notice)
                self.subscriptions(wall())
                self.dirty = True
            subs = link.subs
            if not subs:
                link.drop("no_target", wall())
            elif not (subs[0] == b"" or frames[0].startswith(subs)):
                link.filtered += 1  # the target's SUB would not take it
            else:
                try:
                    _send(send, frames)
                    link.forwarded += 1
                except zmq.Again:
                    link.drop("queue_full", wall())
            try:
                _send(hand, frames)
            except zmq.Again:
                self.analysis_dropped += 1

    def subscriptions(self, wall: float) -> None:
        assert self.xpub is not None
        while True:
            try:
                msg = self.xpub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.link.on_subscription(msg, wall)


def relay_main(control: str, parent: int) -> None:
    """The relay process: its lanes, commands from the collector, statuses back to it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the collector, which stops us
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ctl = ctx.socket(zmq.PAIR)
    ctl.setsockopt(zmq.LINGER, 1000)
    ctl.connect(control)
    ctl.send(b'{"hello": true}')  # queued until connected; then the collector sends commands
    poller = zmq.Poller()
    poller.register(ctl, zmq.POLLIN)
    lanes: dict[int, _Lane] = {}
    roles: dict[zmq.Socket[bytes], tuple[_Lane, str]] = {}
    clock, wall = time.monotonic, time.time
    next_status = 0.0
    errors = 0

    def register(lane: _Lane) -> None:
        for sock, role in lane.sockets():
            if sock not in roles:
                roles[sock] = (lane, role)
                poller.register(sock, zmq.POLLIN)

    def drop(lane: _Lane) -> None:
        for sock, _ in lane.sockets():
            roles.pop(sock, None)
            poller.unregister(sock)
        lane.close()

    try:
        while True:
            ready = poller.poll(POLL_MS)
            commands = False
            for sock, _ in ready:
                if sock is ctl:
                    commands = True
                    continue
                lane, role = roles[sock]
                try:
                    _turn(lane, role, clock, wall)
                except zmq.ContextTerminated:
                    raise
                except Exception:  # one bad turn must not end the relay: say so, go on
                    errors += 1
                    if errors <= 3:
                        traceback.print_exc()
            while commands and ctl.poll(0):
                cmd = json.loads(ctl.recv())
                if cmd["op"] == "stop":
                    return
                if cmd["op"] == "open":
                    lane = lanes[cmd["lane"]] = _Lane(cmd, wall())
                    lane.open_target(ctx)
                    lane.retry_at = clock() + lane.wait_s
                    reason = f"waiting up to {lane.wait_s:g} s for {lane.link.target} to subscribe"
                    lane.set("starting", f"{reason} before binding {lane.endpoint}", wall())
                    register(lane)
                elif (gone := lanes.pop(cmd["lane"], None)) is not None:
                    drop(gone)
            now = clock()
            for lane in lanes.values():
                # bound once the target subscribed (Relay.open), then as retried
                due = (lane.state == "starting" and lane.link.up) or now >= lane.retry_at
                if lane.sub is None and due and lane.bind(ctx, now, wall()):
                    register(lane)
            periodic = now >= next_status
            if periodic:  # counters; a parent that is gone ends us
                if os.getppid() != parent:
                    return
                next_status = now + STATUS_S
            for lane in lanes.values():
                if periodic or lane.dirty or lane.topics_dirty:
                    topics = lane.topics_dirty or now - lane.topics_sent_at >= TOPICS_EVERY_S
                    try:
                        ctl.send(json.dumps(lane.status(topics)).encode(), zmq.NOBLOCK)
                    except zmq.Again:  # the collector is behind: the next status says it all
                        continue
                    lane.dirty = False
                    if topics:
                        lane.topics_dirty, lane.topics_sent_at = False, now
    except zmq.ContextTerminated:
        pass
    finally:
        for lane in lanes.values():
            lane.close()
        ctx.destroy(linger=0)


def _local(name: str) -> str:
    """An endpoint only this host reaches, to bind (see Relay.handoff_endpoint)."""
    return f"ipc://@{name}" if sys.platform.startswith("linux") else "tcp://127.0.0.1:*"


def _send(send: Callable[..., Any], frames: list[bytes]) -> None:
    """One multipart message without waiting: zmq.Again when the first frame is refused (the
    queue is full); the others then always go (a message is all or nothing)."""
    last = len(frames) - 1
    send(frames[0], _NOBLOCK | _SNDMORE if last else _NOBLOCK)
    for i in range(1, last):
        send(frames[i], _SNDMORE)
    if last:
        send(frames[last], 0)


def _turn(lane: _Lane, role: str, clock: Callable[[], float], wall: Callable[[], float]) -> None:
    """What one readable socket of a lane wants: frames to forward, a subscription, an event."""
    if role == "sub":
        lane.forward(wall)
        return
    if role == "xpub":
        lane.subscriptions(wall())
    elif role == "xmon":
        assert lane.xmon is not None
        for msg in _monitor(lane.xmon):
            lane.link.on_monitor(int(msg["event"]), clock(), wall())
    else:
        assert lane.smon is not None
        for msg in _monitor(lane.smon):
            lane.on_listen_monitor(int(msg["event"]), int(msg["value"]), wall())
    lane.dirty = True


def _monitor(mon: zmq.Socket[bytes]) -> list[Any]:
    out: list[Any] = []
    while True:
        try:
            out.append(parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK)))
        except zmq.Again:
            return out


# --- the collector's side ----------------------------------------------------------------------


class Relay:
    """The relay process as the ingest thread sees it: start, open/close lanes, their status."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self._ctx = ctx
        # numbered, not id(self): a freed Relay's id comes back, and with it its ipc names,
        # which libzmq releases after close() returns (a bind at once fails: address in use)
        self._name = f"kvobserve-relay-{os.getpid()}-{next(_NUMBERS)}"
        self.control: zmq.Socket[bytes] | None = None
        self._proc: Any = None
        self.status: dict[int, dict[str, Any]] = {}  # lane -> its last status
        self._lanes = 0
        # commands wait here until the process said hello: a PAIR with no peer yet would block
        self._pending: list[bytes] = []
        self._ready = False

    def handoff_endpoint(self) -> tuple[int, str]:
        """A new lane id and where its frames are handed over: an ipc endpoint in Linux's
        abstract namespace (no file to clean up), elsewhere loopback TCP (bind it, then ask the
        socket for its LAST_ENDPOINT)."""
        self._lanes += 1
        return self._lanes, _local(f"{self._name}-{self._lanes}")

    def open(self, lane: int, endpoint: str, target: str, queue: int, handoff: str,
             rcvhwm: int, rebind_s: float, wait_s: float) -> None:  # fmt: skip
        """Relay `endpoint` to `target` from now on (the process starts on first use): bound
        once the target subscribed (the engines' frames wait in their own queues meanwhile,
        instead of being dropped for want of a target), or after `wait_s` anyway."""
        if self._proc is None:
            self._start()
        self._send({"op": "open", "lane": lane, "endpoint": endpoint, "target": target,
                    "queue": queue, "handoff": handoff, "rcvhwm": rcvhwm,
                    "rebind_s": rebind_s, "wait_s": wait_s})  # fmt: skip

    def close(self, lane: int) -> None:
        """Stop relaying one lane (its bound endpoint is released)."""
        self.status.pop(lane, None)
        if self._proc is not None:
            self._send({"op": "close", "lane": lane})

    def drain(self) -> list[int]:
        """Read the statuses waiting on the control socket; the lanes they were about."""
        got: list[int] = []
        assert self.control is not None
        while True:
            try:
                st = json.loads(self.control.recv(zmq.NOBLOCK))
            except zmq.Again:
                return got
            if st.get("hello"):  # connected: what was asked meanwhile goes now
                self._ready = True
                pending, self._pending = self._pending, []
                for cmd in pending:
                    self._post(cmd)
                continue
            self.status[st["lane"]] = st
            got.append(st["lane"])

    def _start(self) -> None:
        ctl = self.control = self._ctx.socket(zmq.PAIR)
        ctl.setsockopt(zmq.LINGER, 0)
        ctl.bind(_local(f"{self._name}-control"))
        endpoint = ctl.getsockopt_string(zmq.LAST_ENDPOINT)
        # a plain subprocess (not multiprocessing: no resource tracker beside it)
        cmd = [sys.executable, "-m", __name__, endpoint, str(os.getpid())]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        log.info("relay process started (pid %d)", self._proc.pid)

    def _send(self, cmd: dict[str, Any]) -> None:
        data = json.dumps(cmd).encode()
        if self._ready:
            self._post(data)
        else:
            self._pending.append(data)

    def _post(self, data: bytes) -> None:
        assert self.control is not None
        with contextlib.suppress(zmq.Again):  # never block: a process that is gone is restarted
            self.control.send(data, zmq.NOBLOCK)

    @property
    def alive(self) -> bool:
        """Whether the relay process runs."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def exit_status(self) -> str:
        """How the process ended, for a person: `exit 1`, `killed by SIGKILL`."""
        code = self._proc.poll() if self._proc is not None else None
        if code is None:
            return "running"
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"

    def stop(self, timeout: float = 0.5) -> None:
        """End the process (by its PID when it does not stop on request; within 3 x `timeout`,
        so a collector still ends within 2 s of SIGTERM); idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if self.control is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self.control.send(b'{"op": "stop"}', zmq.NOBLOCK)
            for end in (None, proc.terminate, proc.kill):
                if end is not None:
                    end()
                try:
                    proc.wait(timeout)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self.control is not None:
            self.control.close(linger=0)
            self.control = None


if __name__ == "__main__":  # the relay process: python -m kvobserve.sources.relay CONTROL PPID
    relay_main(sys.argv[1], int(sys.argv[2]))
