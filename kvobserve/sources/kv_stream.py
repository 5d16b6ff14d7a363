"""The ZMQ shell of one collector's stream core: one thread, every socket, one handler table.

The stream core (sources/stream_table.py) holds every stream's state and says what the sockets
should do; this thread carries that out and reports back. It owns every socket (the SUBs of
connect mode with their monitors, replay DEALERs, topic probes, the SUBs bound in bind mode or the
relay process's hand-over sockets), so the hot path takes no locks: it drains each readable
socket without blocking and hands each message to the core. Each socket has one handler in one
table; a turn polls, runs the handlers of what is readable, ticks the core and carries out the
actions the turn produced. Other threads talk to it only through `call()`, which runs a function
in this thread at once (it wakes the poll through a socket pair) and returns a Future.
ZMQ reconnects by itself with backoff (RECONNECT_IVL .. RECONNECT_IVL_MAX), so an engine that is
not up yet is simply `up 0` until it is; each SUB's socket monitor says why (sources/link.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.sources.bind import Listener
from kvobserve.sources.capacity_stats import WorkerCurve
from kvobserve.sources.checkpoint_store import identity_of
from kvobserve.sources.checkpoint_writer import CheckpointWriter
from kvobserve.sources.ingest_actions import (
    Bind,
    Connect,
    Disconnect,
    EndProbe,
    EndReplay,
    Probe,
    Replay,
    Restore,
    SocketAction,
    Unbind,
)
from kvobserve.sources.ingest_options import IngestOptions
from kvobserve.sources.ingest_stats import IngestStats, build_stats
from kvobserve.sources.link import MONITOR_EVENTS
from kvobserve.sources.overlap import rank_overlaps
from kvobserve.sources.plan import ListenSpec, StreamSpec
from kvobserve.sources.relay import Relay, bind_endpoint, peer_of
from kvobserve.sources.replays import DRAIN_LIMIT
from kvobserve.sources.stream_events import RecentEvents
from kvobserve.sources.stream_state import WatchedStream
from kvobserve.sources.stream_table import StreamTable
from kvobserve.sources.topic_probe import MAX_MESSAGES
from kvobserve.wire.kv_events import BlockHash
from kvobserve.wire.misses import MissFeedback
from kvobserve.wire.overlap import RankOverlap
from kvobserve.wire.replay import encode_replay_request

log = logging.getLogger(__name__)
T = TypeVar("T")

# plain ints: recv_multipart() spends ~20% of its time converting RCVMORE to an Enum per frame
_RCVMORE, _NOBLOCK, _SRCFD = int(zmq.RCVMORE), int(zmq.NOBLOCK), int(zmq.SRCFD)
Socket = zmq.Socket[bytes]
Handler = Callable[[float], None]
FLUSH_S = 1.0  # at stop, checkpoints are written for this long (a collector ends within 2 s)


class IngestLoop:
    """The ingest thread of one collector: the stream core and its sockets."""

    def __init__(
        self,
        specs: Sequence[StreamSpec],
        options: IngestOptions | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        events: RecentEvents | None = None,
        listens: Sequence[ListenSpec] = (),
        pools: Mapping[str, str] | None = None,
        checkpoints: CheckpointWriter | None = None,
        fingerprint: Callable[[str], str] | None = None,
        curves: Mapping[str, WorkerCurve] | None = None,
    ) -> None:
        self.options = options or IngestOptions()
        self._clock, self._wall = clock, wall
        self.events = events if events is not None else RecentEvents(wall=wall)
        # checkpoints (docs/reliability.md): their writer, and each worker's config fingerprint
        self.checkpoints = checkpoints if checkpoints is not None and checkpoints.enabled else None
        self.table = StreamTable(
            self.options, events=self.events, pools=pools, curves=curves,
            fingerprint=fingerprint if self.checkpoints is not None else None,
        )  # fmt: skip
        self._ctx: zmq.Context[Socket] = zmq.Context()
        self._poller = zmq.Poller()
        self._handlers: dict[Any, Handler] = {}  # socket (or a file descriptor) -> its handler
        # the sockets of each stream and endpoint: (socket, monitor or None)
        self._subs: dict[WatchedStream, tuple[Socket, Socket]] = {}
        self._replays: dict[WatchedStream, Socket] = {}
        self._probes: dict[WatchedStream, Socket] = {}
        self._bound: dict[Listener, tuple[Socket, Socket | None]] = {}  # SUB/inbox, monitor
        self._relay: Relay | None = None  # the relay process, from the first relay_to on
        self._lanes: dict[int, Listener] = {}
        self._lane_of: dict[Listener, int] = {}
        self._calls: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        # call() writes a byte to wake the poll: a call waits for no tick (an overlap question
        # is answered in microseconds, not in up to tick_s)
        self._wake_rx, self._wake_tx = socket.socketpair()
        self._wake_rx.setblocking(False)
        self._wake_tx.setblocking(False)
        # zmq's poll names a ready non-ZMQ socket by its file descriptor, not by the object
        self._watch(self._wake_rx, self._wake_rx.fileno(), lambda now: self._drain_wake())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvobserve-ingest", daemon=True)
        self._initial = (list(specs), list(listens))
        self.loop_errors = 0
        self._next_relay_check = 0.0

    # --- public, any thread -----------------------------------------------------------------

    def start(self) -> None:
        """Open the sockets and start the thread (and the checkpoints' writer)."""
        if self.checkpoints is not None:
            self.checkpoints.start()
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread and close every socket (linger 0); idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._ctx.closed:
            self._ctx.destroy(linger=0)
        self._wake_tx.close()
        self._wake_rx.close()
        if self.checkpoints is not None:
            self.checkpoints.close()

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` in the ingest thread; the Future gets its result."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._stop.is_set():
            fut.set_exception(RuntimeError("ingest loop stopped"))
            return fut
        self._calls.append((fn, fut))
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway), or closed
            self._wake_tx.send(b"\0")
        return fut

    def stats(
        self,
        whole: frozenset[str] = frozenset(),
        capacities: Mapping[tuple[str, int], tuple[float, float]] | None = None,
    ) -> concurrent.futures.Future[IngestStats]:
        """A consistent picture of every stream, built in the ingest thread; `whole`: workers
        whose every rank this collector watches (their placement needs no sketch);
        `capacities`: the engines' KV capacity by stream (tokens, read at: wall clock)."""
        ck = self.checkpoints
        return self.call(
            lambda: build_stats(
                self.table, self._clock(), self._wall(), whole, self.loop_errors,
                ck.stats() if ck is not None else None, capacities,
            )
        )  # fmt: skip

    def overlap(
        self, hashes: list[BlockHash], workers: frozenset[str] | None = None
    ) -> concurrent.futures.Future[list[RankOverlap]]:
        """For each stream of `workers` (None: every stream), how many leading blocks of
        `hashes` its top tier holds now (sources/overlap.py), walked in the ingest thread."""

        def answer() -> list[RankOverlap]:
            keep = None if workers is None else workers.__contains__
            return rank_overlaps(
                (
                    (k[0], k[1], st.seq, st.link.health.up if st.link is not None else st.connected)
                    for k, st in self.table.sequencers(keep)
                    if st.seq is not None
                ),
                hashes,
            )

        return self.call(answer)

    def set_specs(
        self, specs: Sequence[StreamSpec], listens: Sequence[ListenSpec] | None = None
    ) -> concurrent.futures.Future[None]:
        """Watch exactly `specs` (and bind exactly `listens`, None: as now) from now on
        (rediscovery); unchanged streams keep their state."""
        return self.call(lambda: self._apply(specs, listens))

    def follow(self, fb: MissFeedback, collector_id: str) -> concurrent.futures.Future[None]:
        """Take the aggregator's word on the miss split (levels, resyncs) in the ingest thread."""
        misses = self.table.misses
        if misses is None:
            fut: concurrent.futures.Future[None] = concurrent.futures.Future()
            fut.set_result(None)
            return fut
        return self.call(lambda: misses.follow(fb, collector_id))

    @property
    def received_total(self) -> int:
        """Messages read off the KV-event sockets so far (any thread; a plain int read)."""
        return self.table.received_total

    def sequencer(self, worker_id: str, dp_rank: int) -> StreamSequencer | None:
        """The sequencer of a stream (read it only via `call`, or after `stop`)."""
        st = self.table.streams.get((worker_id, dp_rank))
        return st.seq if st is not None else None

    # --- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        self._apply(*self._initial)
        tick_ms = int(self.options.tick_s * 1000)
        handlers, table = self._handlers, self.table
        while not self._stop.is_set():
            try:
                ready = self._poller.poll(tick_ms)
                if self._calls:  # a caller waits (an overlap question): before the batches
                    self._run_calls()
                now = self._clock()
                for sock, _ in ready:
                    handler = handlers.get(sock)
                    if handler is not None:  # None: closed by an earlier handler this turn
                        handler(now)
                self._run_calls()
                now = self._clock()
                table.tick(now, self._wall())
                self._carry_out()
                if self.checkpoints is not None:
                    self.checkpoints.tick(now, table.checkpointables())
                if self._relay is not None and now >= self._next_relay_check:
                    self._next_relay_check = now + 1.0
                    self._check_relay()
            except zmq.ContextTerminated:
                break
            except Exception:  # one bad turn must not end ingest: count, log, go on
                self.loop_errors += 1
                log.exception("ingest loop error (continuing)")
        if self.checkpoints is not None:  # SIGTERM: what changed, in the time stop() allows
            self.checkpoints.flush(table.checkpointables(), FLUSH_S)
        table.close_all()
        self._carry_out()
        self._forget_relay()
        while self._calls:
            _, fut = self._calls.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("ingest loop stopped"))

    def _apply(self, specs: Sequence[StreamSpec], listens: Sequence[ListenSpec] | None) -> None:
        self.table.apply(specs, listens, self._clock(), self._wall())
        self._carry_out()

    def _drain_wake(self) -> None:
        """Empty the wake-up socket (the calls it announced run in this turn)."""
        with contextlib.suppress(BlockingIOError):  # drained
            while self._wake_rx.recv(4096):
                pass

    def _run_calls(self) -> None:
        while self._calls:
            fn, fut = self._calls.popleft()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except Exception as exc:
                    fut.set_exception(exc)
        self._carry_out()  # a call may have changed the plan

    def _watch(self, sock: Any, key: Any, handler: Handler) -> None:
        self._handlers[key] = handler
        self._poller.register(sock, zmq.POLLIN)

    def _unwatch(self, sock: Socket | None) -> None:
        if sock is not None and self._handlers.pop(sock, None) is not None:
            self._poller.unregister(sock)

    # --- carrying out the core's actions ------------------------------------------------------

    def _carry_out(self) -> None:
        """Every action the core asked for, in order (an action may produce more)."""
        table = self.table
        while table.out:
            for action in table.take_actions():
                self._act(action)

    def _act(self, a: SocketAction) -> None:
        if isinstance(a, Connect):
            self._connect(a.stream)
        elif isinstance(a, Disconnect):
            self._close_pair(self._subs.pop(a.stream, None))
        elif isinstance(a, Replay):
            self._replay(a)
        elif isinstance(a, EndReplay):
            self._close_one(self._replays.pop(a.stream, None))
        elif isinstance(a, Probe):
            self._probe(a.stream)
        elif isinstance(a, EndProbe):
            self._close_one(self._probes.pop(a.stream, None))
        elif isinstance(a, Restore):
            self._restore(a.stream)
        elif isinstance(a, Bind):
            self._bind(a.listener)
        elif isinstance(a, Unbind):
            self._unbind(a.listener)

    def _restore(self, st: WatchedStream) -> None:
        ck = self.checkpoints
        got = ck.store.load(identity_of(st.spec), st.config) if ck is not None else None
        self.table.restored(st, got, self._clock(), self._wall())

    def _close_one(self, sock: Socket | None) -> None:
        if sock is not None:
            self._unwatch(sock)
            sock.close(linger=0)

    def _close_pair(self, pair: tuple[Socket, Socket | None] | None) -> None:
        if pair is None:
            return
        sock, mon = pair
        self._unwatch(sock)
        self._unwatch(mon)
        if mon is not None:
            sock.disable_monitor()
            mon.close(linger=0)
        sock.close(linger=0)

    def _connect(self, st: WatchedStream) -> None:
        o, spec = self.options, st.spec
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, o.rcvhwm)
        sock.setsockopt(zmq.RECONNECT_IVL, o.reconnect_ivl_ms)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, o.reconnect_ivl_max_ms)
        sock.setsockopt(zmq.SUBSCRIBE, spec.topic.encode())
        mon = sock.get_monitor_socket(MONITOR_EVENTS)
        try:
            sock.connect(spec.endpoint)
        except zmq.ZMQError as exc:  # a bad endpoint must not take the others down
            self._close_pair((sock, mon))
            self.table.connect_failed(st, str(exc), self._wall())
            return
        self._subs[st] = (sock, mon)
        self._watch(sock, sock, lambda now: self._drain(st, sock, now))
        self._watch(mon, mon, lambda now: self._monitor(st, mon, now))

    def _replay(self, a: Replay) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)  # a replay may be up to buffer_steps batches at once
        try:
            sock.connect(a.endpoint)
            sock.send_multipart(encode_replay_request(a.start_seq), zmq.NOBLOCK)
        except zmq.ZMQError:
            sock.close(linger=0)
            self.table.replay_failed(a.stream)
            return
        st = a.stream
        self._replays[st] = sock
        self._watch(sock, sock, lambda now: self._drain_replay(st, sock, now))

    def _probe(self, st: WatchedStream) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1000)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            sock.connect(st.spec.endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)
            self.table.probe_failed(st)
            return
        self._probes[st] = sock
        self._watch(sock, sock, lambda now: self._drain_probe(st, sock))

    def _bind(self, lst: Listener) -> None:
        o = self.options
        now, wall = self._clock(), self._wall()
        if lst.spec.relay_to is not None:  # the relay process binds
            try:
                self._bind_relayed(lst)
            except Exception as exc:  # no relay process: say so, try again later
                log.exception("cannot start the relay process")
                self.table.bound(lst, f"cannot start the relay process: {exc}", now, wall)
            else:
                self.table.bound(lst, None, now, wall)
            return
        got = bind_endpoint(self._ctx, lst.spec.endpoint, o.rcvhwm, o.rebind_s)
        if isinstance(got, str):
            self.table.bound(lst, got, now, wall)
            return
        sub, mon = got
        self._bound[lst] = (sub, mon)
        self._watch(sub, sub, lambda now: self._drain_bound(lst, sub, now, relayed=False))
        self._watch(mon, mon, lambda now: self._bound_monitor(lst, mon, now))
        self.table.bound(lst, None, now, wall)

    def _bind_relayed(self, lst: Listener) -> None:
        """Have the relay process bind and forward; read what it hands over (its statuses say
        how the endpoint is doing)."""
        spec, o = lst.spec, self.options
        assert spec.relay_to is not None
        relay = self._relay
        if relay is None:
            relay = self._relay = Relay(self._ctx)
        lane, handoff = relay.handoff_endpoint()
        inbox = self._ctx.socket(zmq.PULL)
        inbox.setsockopt(zmq.LINGER, 0)
        inbox.setsockopt(zmq.RCVHWM, o.rcvhwm)
        inbox.bind(handoff)
        handoff = inbox.getsockopt_string(zmq.LAST_ENDPOINT)  # the port, on loopback TCP
        try:
            relay.open(lane, spec.endpoint, spec.relay_to, spec.relay_queue, handoff,
                       o.rcvhwm, o.rebind_s, o.relay_wait_s)  # fmt: skip
        except Exception:
            inbox.close(linger=0)
            raise
        control = relay.control
        if control is not None and control not in self._handlers:
            self._watch(control, control, lambda now: self._relay_statuses(now))
        self._bound[lst] = (inbox, None)
        self._lanes[lane], self._lane_of[lst] = lst, lane
        self._watch(inbox, inbox, lambda now: self._drain_bound(lst, inbox, now, relayed=True))

    def _unbind(self, lst: Listener) -> None:
        self._close_pair(self._bound.pop(lst, None))
        lane = self._lane_of.pop(lst, None)
        if lane is not None:
            self._lanes.pop(lane, None)
            if self._relay is not None:
                self._relay.close(lane)

    def _check_relay(self) -> None:
        """A relay process that died is started again (its endpoints bound anew by the core)."""
        relay = self._relay
        if relay is None or not self._lanes or relay.alive:
            return
        why = f"the relay process ended ({relay.exit_status}); starting it again"
        for lst in list(self._lanes.values()):
            self._unbind(lst)
        self._forget_relay()
        self.table.relay_ended(why, self._clock(), self._wall())
        self._carry_out()

    def _forget_relay(self) -> None:
        relay, self._relay = self._relay, None
        if relay is None:
            return
        self._unwatch(relay.control)
        relay.stop()

    # --- handlers ---------------------------------------------------------------------------

    def _drain(self, st: WatchedStream, sock: Socket, now: float) -> None:
        wall = self._wall()
        recv, more, take = sock.recv, sock.get, self.table.take
        good = bad = 0
        bad_reason, bad_frames = "", []
        for _ in range(DRAIN_LIMIT):
            try:
                frames = [recv(_NOBLOCK)]
            except zmq.Again:
                break
            while more(_RCVMORE):
                frames.append(recv(_NOBLOCK))
            reason = take(st, frames, now, wall)
            if reason:
                bad, bad_reason, bad_frames = bad + 1, reason, frames
            else:
                good += 1
        self.table.drained(st, good, bad, bad_reason, bad_frames, now, wall)

    def _drain_bound(self, lst: Listener, sock: Socket, now: float, *, relayed: bool) -> None:
        """What waits on a bound endpoint (or its relay's inbox), each message to its stream."""
        wall = self._wall()
        table = self.table
        recv, more, routes, take = sock.recv, sock.get, lst.routes, table.take_bound
        n = 0
        for _ in range(DRAIN_LIMIT):
            try:
                first = recv(_NOBLOCK, copy=False)
            except zmq.Again:
                break
            topic = first.bytes
            frames = [topic]
            while more(_RCVMORE):
                frames.append(recv(_NOBLOCK))
            n += 1
            st = routes.get(topic)
            if st is None:
                # which connection it came on (the monitor's descriptor); the relay's statuses
                # say that of relayed messages
                source = None if relayed else first.get(_SRCFD)
                st = table.route(lst, topic, source, now, wall)
                if st is None:
                    continue
                self._carry_out()  # a new pod's checkpoint before its first message
            take(st, frames, now, wall)
        table.bound_drained(lst, n)

    def _drain_replay(self, st: WatchedStream, sock: Socket, now: float) -> None:
        on_message = self.table.on_replay_message
        for _ in range(DRAIN_LIMIT):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if not on_message(st, frames, now):
                return

    def _drain_probe(self, st: WatchedStream, sock: Socket) -> None:
        on_message = self.table.on_probe_message
        for _ in range(MAX_MESSAGES):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            on_message(st, frames)

    def _monitor(self, st: WatchedStream, mon: Socket, now: float) -> None:
        wall = self._wall()
        for event, value in _events(mon):
            self.table.on_monitor(st, event, value, now, wall)

    def _bound_monitor(self, lst: Listener, mon: Socket, now: float) -> None:
        wall = self._wall()
        for event, value in _events(mon):
            peer = peer_of(value) if event == zmq.EVENT_ACCEPTED else ""
            self.table.on_bound_monitor(lst, event, value, peer, now, wall)

    def _relay_statuses(self, now: float) -> None:
        assert self._relay is not None
        wall = self._wall()
        for lane in self._relay.drain():
            lst = self._lanes.get(lane)
            status = self._relay.status.get(lane)
            if lst is not None and status is not None:
                self.table.on_relay_status(lst, status, now, wall)


def _events(mon: Socket) -> list[tuple[int, int]]:
    """The monitor events waiting (event, value)."""
    out: list[tuple[int, int]] = []
    while True:
        try:
            msg = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return out
        out.append((int(msg["event"]), int(msg["value"])))
