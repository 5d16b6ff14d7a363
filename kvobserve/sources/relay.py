"""The relay of bind mode: every frame of a bound endpoint forwarded unchanged downstream, first.

llm-d's scheduler binds `tcp://*:5556` and the engines connect to it; kvobserve binds that port
instead and forwards to the scheduler (`relay_to`), which binds elsewhere. A thread of its own
(`kvobserve-relay`) owns the bound SUBs and the downstream sockets: it reads each frame, sends it
to the target, and only then hands it to the ingest thread over an inproc PUSH. Analysis never
delays a frame: when the ingest thread is behind, its hand-over queue fills and frames are
skipped there (counted as `analysis_behind`; the stream sees a gap and asks for a replay).

Toward the target the bounded queue is an XPUB's high-water mark (`relay_queue` frames, with
XPUB_NODROP so that a full queue refuses instead of dropping silently) that connects to the
target's bound SUB. IMMEDIATE: nothing queues for a target that is not connected, and its
subscription ends with its connection, so every frame is counted once: forwarded, filtered (the
target did not subscribe to its topic) or dropped (`no_target`: nobody subscribes; `queue_full`).
The ingest thread creates the sockets (a bind that fails is its error to report) and hands them
over; from then on only this thread touches them until it is asked to close them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvobserve.sources.health import Health
from kvobserve.wire.snapshot import RELAY_DROP_REASONS

log = logging.getLogger(__name__)

DRAIN_LIMIT = 512  # frames taken from one bound SUB per poll round
POLL_MS = 100  # how long a command (adopt, close) may wait
_RCVMORE, _EVENTS, _POLLIN = int(zmq.RCVMORE), int(zmq.EVENTS), int(zmq.POLLIN)
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


class RelayLink:
    """One relay target: its state and counters (written by the relay thread, read by others)."""

    __slots__ = (
        "_attempt_at",
        "analysis_dropped",
        "connected",
        "dropped",
        "filtered",
        "forwarded",
        "health",
        "last_drop_time",
        "queue",
        "subs",
        "target",
    )

    def __init__(self, target: str, queue: int, health: Health) -> None:
        self.target, self.queue, self.health = target, queue, health
        self.subs: tuple[bytes, ...] = ()  # the prefixes the target subscribes to
        self.connected = False
        self.forwarded = self.filtered = self.analysis_dropped = 0
        self.dropped = dict.fromkeys(RELAY_DROP_REASONS, 0)
        self.last_drop_time = 0.0  # wall clock; 0: never
        self._attempt_at: float | None = None

    def on_monitor(self, event: int, now: float, wall: float) -> None:
        """One event of the target socket's monitor."""
        h, where = self.health, self.target
        if event == zmq.EVENT_CONNECT_DELAYED:
            if self._attempt_at is None:
                self._attempt_at = now
        elif event == zmq.EVENT_CONNECT_RETRIED:
            slow = self._attempt_at is not None and now - self._attempt_at >= 1.0
            self._attempt_at = None
            if slow:
                h.set("connecting", f"no answer from {where}: the host is down or filtered?", wall)
            else:
                h.set("connecting", f"connection refused: nothing listens at {where}", wall)
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected, self._attempt_at = True, None
            self._update(wall)
        elif event == zmq.EVENT_DISCONNECTED:
            if self.connected:
                h.set("connecting", f"disconnected: {where} went away (restarted?)", wall)
            self.connected = False
        elif event != zmq.EVENT_CONNECTED:  # a failed handshake
            h.set("not_subscriber", f"the ZMQ handshake with {where} failed: not a ZMQ SUB?", wall)

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
        h = self.health
        if self.connected and self.subs:
            shown = ", ".join(repr(s.decode(errors="replace")) for s in self.subs)
            h.set("up", f"forwarding to {self.target} (it subscribes to {shown})", wall)
        elif self.connected:
            h.set("waiting", f"connected to {self.target}; it has not subscribed yet", wall)

    def drop(self, reason: str, wall: float) -> None:
        """One frame not forwarded."""
        self.dropped[reason] += 1
        self.last_drop_time = wall

    @property
    def up(self) -> bool:
        """Connected and subscribed: frames reach the target."""
        return self.connected and bool(self.subs)


@dataclass(eq=False)
class Lane:
    """The sockets of one relayed endpoint: bound SUB in, target XPUB (and its monitor) out,
    inproc PUSH to the ingest thread."""

    sub: zmq.Socket[bytes]
    xpub: zmq.Socket[bytes]
    xmon: zmq.Socket[bytes]
    push: zmq.Socket[bytes]
    link: RelayLink


def target_socket(ctx: zmq.Context[zmq.Socket[bytes]], link: RelayLink) -> zmq.Socket[bytes]:
    """The XPUB that connects to `link.target`: bounded, refusing when full, no queue before the
    target is connected (see the module docstring)."""
    x = ctx.socket(zmq.XPUB)
    x.setsockopt(zmq.LINGER, 0)
    x.setsockopt(zmq.SNDHWM, link.queue)
    x.setsockopt(zmq.XPUB_NODROP, 1)
    x.setsockopt(zmq.IMMEDIATE, 1)
    x.setsockopt(zmq.RECONNECT_IVL, 100)
    x.setsockopt(zmq.RECONNECT_IVL_MAX, 5_000)
    return x


class Relay:
    """The relay thread; `adopt` and `close` lanes from any thread (applied within POLL_MS)."""

    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self._wall = wall
        self._commands: deque[tuple[str, Lane, threading.Event | None]] = deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lanes: dict[zmq.Socket[bytes], Lane] = {}
        self._role: dict[zmq.Socket[bytes], str] = {}
        self._poller = zmq.Poller()
        self.loop_errors = 0

    def adopt(self, lane: Lane) -> None:
        """Take over a lane's sockets (created and bound by the caller)."""
        self._commands.append(("adopt", lane, None))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvobserve-relay", daemon=True)
            self._thread.start()

    def close(self, lane: Lane, timeout: float = 2.0) -> None:
        """Close a lane's sockets in the relay thread; returns when they are closed."""
        if self._thread is None or not self._thread.is_alive():
            _close(lane)
            return
        done = threading.Event()
        self._commands.append(("close", lane, done))
        done.wait(timeout)

    def stop(self, timeout: float = 2.0) -> None:
        """End the thread, closing every lane; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        while self._commands:  # never adopted, or the thread is gone: close them here
            _, lane, done = self._commands.popleft()
            _close(lane)
            if done is not None:
                done.set()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_commands()
                try:
                    ready = self._poller.poll(POLL_MS)
                except zmq.ZMQError:  # a socket closed under the poller (context ending)
                    break
                for sock, _ in ready:
                    lane = self._lanes.get(sock)
                    if lane is None:
                        continue
                    try:
                        role = self._role[sock]
                        if role == "sub":
                            self._forward(lane)
                        elif role == "xpub":
                            self._subscriptions(lane)
                        else:
                            self._monitor(lane)
                    except zmq.ContextTerminated:
                        return
                    except Exception:  # one bad turn must not end the relay: count, log, go on
                        self.loop_errors += 1
                        log.exception("relay error (continuing)")
        finally:
            for lane in {id(x): x for x in self._lanes.values()}.values():
                _close(lane)
            self._lanes.clear()

    def _apply_commands(self) -> None:
        while self._commands:
            what, lane, done = self._commands.popleft()
            if what == "adopt":
                for sock, role in ((lane.sub, "sub"), (lane.xpub, "xpub"), (lane.xmon, "mon")):
                    self._lanes[sock], self._role[sock] = lane, role
                    self._poller.register(sock, zmq.POLLIN)
            else:
                for sock in (lane.sub, lane.xpub, lane.xmon):
                    if self._lanes.pop(sock, None) is not None:
                        self._role.pop(sock, None)
                        self._poller.unregister(sock)
                _close(lane)
            if done is not None:
                done.set()

    def _forward(self, lane: Lane) -> None:
        """Forward what waits on the bound SUB, then hand it to the ingest thread."""
        recv, more = lane.sub.recv, lane.sub.get
        send, hand, events = lane.xpub.send_multipart, lane.push.send_multipart, lane.xpub.get
        link = lane.link
        for _ in range(DRAIN_LIMIT):
            try:
                frames = [recv(zmq.NOBLOCK)]
            except zmq.Again:
                break
            while more(_RCVMORE):
                frames.append(recv(zmq.NOBLOCK))
            if int(events(_EVENTS)) & _POLLIN:
                # the target's (un)subscription first: a send after its connection ended is
                # dropped by the XPUB without a word (reading EVENTS also makes libzmq notice)
                self._subscriptions(lane)
            subs = link.subs
            if not subs:
                link.drop("no_target", self._wall())
            elif not (subs[0] == b"" or frames[0].startswith(subs)):
                link.filtered += 1  # the target's SUB would not take it
            else:
                try:
                    send(frames, zmq.NOBLOCK)
                    link.forwarded += 1
                except zmq.Again:
                    link.drop("queue_full", self._wall())
            try:
                hand(frames, zmq.NOBLOCK)
            except zmq.Again:
                link.analysis_dropped += 1

    def _subscriptions(self, lane: Lane) -> None:
        while True:
            try:
                msg = lane.xpub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            lane.link.on_subscription(msg, self._wall())

    def _monitor(self, lane: Lane) -> None:
        while True:
            try:
                msg = parse_monitor_message(lane.xmon.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            lane.link.on_monitor(int(msg["event"]), time.monotonic(), self._wall())


def _close(lane: Lane) -> None:
    """Close a lane's relay-side sockets (linger 0)."""
    for monitored in (lane.sub, lane.xpub):
        with contextlib.suppress(zmq.ZMQError):
            monitored.disable_monitor()
    for sock in (lane.sub, lane.xpub, lane.xmon, lane.push):
        if not sock.closed:
            sock.close(linger=0)
