"""ZMQ ingest of one collector: a SUB per (worker, dp_rank) stream, replay DEALERs, probe ports.

One thread owns every socket and every StreamSequencer, so the hot path takes no locks: it
drains each readable SUB without blocking, decodes, and hands the batch to the stream's
sequencer. Other threads talk to it only through `call()`, which runs a function in the
ingest thread at once (it wakes the poll through a socket pair) and returns a Future.
ZMQ reconnects by itself with backoff (RECONNECT_IVL .. RECONNECT_IVL_MAX), so an engine that is
not up yet is simply `up 0` until it is; each SUB's socket monitor says why (sources/link.py).
In bind mode the loop also drains the endpoints it binds (sources/bind.py), routing each message
to its stream by topic; a relayed endpoint is read by the relay process first (sources/relay.py).
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
from dataclasses import dataclass, field
from typing import Any, TypeVar

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvobserve.analysis.mirror import MirrorDetector
from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.sources import cache_stats
from kvobserve.sources.bind import Listener
from kvobserve.sources.capacity_stats import RankCurves, WorkerCurve
from kvobserve.sources.ingest_options import IngestOptions
from kvobserve.sources.link import MONITOR_EVENTS, Link
from kvobserve.sources.miss_stats import UNTIL_SLACK_S, MissSamplers
from kvobserve.sources.overlap import rank_overlaps
from kvobserve.sources.plan import ListenSpec, StreamSpec
from kvobserve.sources.relay import Relay
from kvobserve.sources.replays import DRAIN_LIMIT, ReplayClient
from kvobserve.sources.stream_events import RecentEvents, StreamHistory
from kvobserve.sources.stream_state import WatchedStream, count_bad, new_link, stream_stats
from kvobserve.sources.topic_probe import TopicProbes
from kvobserve.wire.capacity import RankCurveStats
from kvobserve.wire.errors import WireError
from kvobserve.wire.kv_events import BlockHash, decode_message
from kvobserve.wire.misses import MissDelta, MissFeedback
from kvobserve.wire.overlap import RankOverlap
from kvobserve.wire.snapshot import BindStats, StreamStats, UnexpectedStream, WorkerPlacement

log = logging.getLogger(__name__)
T = TypeVar("T")

_RCVMORE = int(zmq.RCVMORE)


@dataclass(frozen=True)
class IngestStats:
    """What the ingest thread reports for one snapshot."""

    streams: list[StreamStats]
    unexpected: list[UnexpectedStream]
    refused: dict[str, int]  # what a cardinality cap refused: streams, medium_events
    messages_received: int = 0
    loop_errors: int = 0
    placement: list[WorkerPlacement] = field(default_factory=list)
    binds: list[BindStats] = field(default_factory=list)  # bind mode: the endpoints bound
    pods: dict[str, list[str]] = field(default_factory=dict)  # [[worker]] id -> its pods' ids
    misses: list[MissDelta] = field(default_factory=list)  # the miss split's, one per pool
    curves: list[RankCurveStats] = field(default_factory=list)  # every curve interval


class IngestLoop:
    """The ingest thread of one collector."""

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
        curves: Mapping[str, WorkerCurve] | None = None,
    ) -> None:
        self.options = options or IngestOptions()
        self._clock, self._wall = clock, wall
        self.events = events if events is not None else RecentEvents(wall=wall)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._streams: dict[tuple[str, int], WatchedStream] = {}
        self._mirrors: dict[str, MirrorDetector] = {}
        self._by_sock: dict[zmq.Socket[bytes], WatchedStream] = {}
        self._by_monitor: dict[zmq.Socket[bytes], WatchedStream] = {}
        self._poller = zmq.Poller()
        o = self.options
        self.replays = ReplayClient(
            self._ctx, self._poller, o.max_concurrent_replays, o.max_payload, clock
        )
        self.topic_probes = TopicProbes(self._ctx, self._poller)
        self._next_tick = 0.0
        self._calls: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        # call() writes a byte to wake the poll: a call waits for no tick (an overlap question
        # is answered in microseconds, not in up to tick_s)
        self._wake_rx, self._wake_tx = socket.socketpair()
        self._wake_rx.setblocking(False)
        self._wake_tx.setblocking(False)
        self._poller.register(self._wake_rx, zmq.POLLIN)
        # zmq's poll names a ready non-ZMQ socket by its file descriptor, not by the object
        self._wake_fd = self._wake_rx.fileno()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvobserve-ingest", daemon=True)
        self._initial = list(specs)
        self._initial_listens = list(listens)
        self._listeners: dict[tuple[str, int], Listener] = {}
        self._by_inbox: dict[zmq.Socket[bytes], Listener] = {}
        self._by_lmon: dict[zmq.Socket[bytes], Listener] = {}
        self._pods: dict[tuple[str, int], Listener] = {}  # streams named by a topic template
        self._refused_pods: set[tuple[str, int]] = set()
        self._relay: Relay | None = None  # the relay process, from the first relay_to on
        self._by_lane: dict[int, Listener] = {}
        self._registered: set[zmq.Socket[bytes]] = set()  # relay control sockets polled
        self._refused_streams: set[tuple[str, int]] = set()  # refused by the last plan
        self.refused_streams_total = 0
        self._warned_refused = False
        self.received_total = 0
        self.loop_errors = 0
        a = self.options.analytics
        self._placements = cache_stats.Placements(a) if a is not None else None
        # the miss split (sources/miss_stats.py): [[worker]] id -> its pool; with the analytics
        self.misses = MissSamplers(pools or {}) if a is not None else None
        # the capacity curves (sources/capacity_stats.py), fed by the miss split's samplers
        c = self.options.curve
        self.curves = RankCurves(c, curves or {}) if a is not None and c is not None else None

    # --- public, any thread -----------------------------------------------------------------

    def start(self) -> None:
        """Open the sockets and start the thread."""
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

    def stats(self, whole: frozenset[str] = frozenset()) -> concurrent.futures.Future[IngestStats]:
        """A consistent picture of every stream, built in the ingest thread; `whole`: workers
        whose every rank this collector watches (their placement needs no sketch)."""
        return self.call(lambda: self._build_stats(whole))

    def overlap(
        self, hashes: list[BlockHash], workers: frozenset[str] | None = None
    ) -> concurrent.futures.Future[list[RankOverlap]]:
        """For each stream of `workers` (None: every stream), how many leading blocks of
        `hashes` its top tier holds now (sources/overlap.py), walked in the ingest thread."""

        def answer() -> list[RankOverlap]:
            return rank_overlaps(
                (
                    (st.spec.worker_id, st.spec.dp_rank, st.seq,
                     st.link.health.up if st.link is not None else st.connected)
                    for st in self._streams.values()
                    if st.seq is not None and (workers is None or st.spec.worker_id in workers)
                ),
                hashes,
            )  # fmt: skip

        return self.call(answer)

    def set_specs(
        self, specs: Sequence[StreamSpec], listens: Sequence[ListenSpec] | None = None
    ) -> concurrent.futures.Future[None]:
        """Watch exactly `specs` (and bind exactly `listens`, None: as now) from now on
        (rediscovery); unchanged streams keep their state."""
        return self.call(lambda: self._apply_specs(specs, listens))

    def follow(self, fb: MissFeedback, collector_id: str) -> concurrent.futures.Future[None]:
        """Take the aggregator's word on the miss split (levels, resyncs) in the ingest thread."""
        misses = self.misses
        if misses is None:
            fut: concurrent.futures.Future[None] = concurrent.futures.Future()
            fut.set_result(None)
            return fut
        return self.call(lambda: misses.follow(fb, collector_id))

    def sequencer(self, worker_id: str, dp_rank: int) -> StreamSequencer | None:
        """The sequencer of a stream (read it only via `call`, or after `stop`)."""
        st = self._streams.get((worker_id, dp_rank))
        return st.seq if st is not None else None

    # --- the ingest thread --------------------------------------------------------------------

    def _run(self) -> None:
        self._apply_specs(self._initial, self._initial_listens)
        tick_ms = int(self.options.tick_s * 1000)
        while not self._stop.is_set():
            try:
                ready = self._poller.poll(tick_ms)
                if self._calls:  # a caller waits (an overlap question): before the batches
                    self._run_calls()
                now = self._clock()
                for sock, _ in ready:
                    st = self._by_sock.get(sock)
                    if st is not None:
                        self._drain(st, sock, now)
                    elif (lst := self._by_inbox.get(sock)) is not None:
                        self._drain_bound(lst, sock, now)
                    elif (lst := self._by_lmon.get(sock)) is not None:
                        self._on_listener_monitor(lst, sock, now)
                    elif self._relay is not None and sock is self._relay.control:
                        self._on_relay_status(now)
                    elif (st := self.replays.by_sock.get(sock)) is not None:
                        self.replays.drain(st, sock)
                    elif (st := self._by_monitor.get(sock)) is not None:
                        self._on_monitor(st, sock, now)
                    elif sock in self.topic_probes.by_sock:
                        self.topic_probes.drain(sock)
                    elif sock == self._wake_fd:
                        self._drain_wake()
                self._housekeeping(self._clock())
            except zmq.ContextTerminated:
                break
            except Exception:  # one bad turn must not end ingest: count, log, go on
                self.loop_errors += 1
                log.exception("ingest loop error (continuing)")
        self._close_all()

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

    def _housekeeping(self, now: float) -> None:
        self._run_calls()
        for st in self._streams.values():
            if st.seq is not None:
                action = st.seq.expire(now)
                if action is not None:
                    self.replays.act(st, action)
        self.replays.start_queued()
        if now >= self._next_tick:  # connection states: once a second is plenty
            self._next_tick = now + 1.0
            self._tick_links(now)

    def _tick_links(self, now: float) -> None:
        wall = self._wall()
        self.topic_probes.expire(now, wall)
        self._tick_listeners(now, wall)
        for st in self._streams.values():
            link = st.link
            if link is None:
                continue
            link.tick(now, wall)
            last, connected = link.last_data, link.zmq_at
            if st.seq is not None and last is not None and connected is not None:
                # an idle stream asks for batches after its last one (a lost tail shows no gap);
                # a SUB that connected again since may face another publisher process
                ask = st.seq.check_tail(now, last, reconnected=connected > last)
                if ask is not None:
                    self.replays.act(st, ask)
            if link.wants_probe(now):
                self.topic_probes.open(link, now)
            elif link.wants_park(now) and st.sock is not None:
                self._close(st)
                link.park(now)
            elif link.wants_reopen(now):
                link.reopened()
                self._open(st)

    def _drain(self, st: WatchedStream, sock: zmq.Socket[bytes], now: float) -> None:
        wall = self._wall()
        # recv_multipart() spends ~20% of its time converting RCVMORE to an Enum per frame:
        # the same loop with the plain int option
        recv, more, take = sock.recv, sock.get, self._take
        good = bad = 0
        bad_reason, bad_frames = "", []
        for _ in range(DRAIN_LIMIT):
            try:
                frames = [recv(zmq.NOBLOCK)]
            except zmq.Again:
                break
            while more(_RCVMORE):
                frames.append(recv(zmq.NOBLOCK))
            self.received_total += 1
            reason = take(st, frames, now, wall)
            if reason:
                bad, bad_reason, bad_frames = bad + 1, reason, frames
            else:
                good += 1
        if st.link is not None and (good or bad):
            st.link.on_data(good, bad, bad_reason, bad_frames, now, wall)

    def _take(self, st: WatchedStream, frames: list[bytes], now: float, wall: float) -> str:
        """Decode one message of `st` and hand it to its sequencer; "" or why it did not decode."""
        st.last_seen = now
        try:
            batch = decode_message(frames, self.options.max_payload)
        except WireError as exc:
            seq_frame = frames[1] if len(frames) == 3 else b""
            count_bad(st, exc.reason, seq_frame)
            return exc.reason
        if batch.unknown_events:
            st.decode_errors["unknown_event"] = (
                st.decode_errors.get("unknown_event", 0) + batch.unknown_events
            )
        seq = st.seq
        if seq is None:  # a probe port: anything that decodes is an unexpected stream
            st.batches += 1
            return ""
        st.last_lag = wall - batch.ts
        payload = frames[2]
        if st.mirror is not None:
            # a mirror carries identical bytes; lockstep ranks (same seq and ts, events
            # alike, even the same rank label when one is mislabelled) do not
            fingerprint = (batch.seq, batch.ts, hash(payload))
            other = st.mirror.observe(seq, fingerprint, now)
            if other is not None:
                log.debug("mirrored stream on %s", st.spec.endpoint)
        action = seq.on_batch(batch, payload, now)
        if action is not None:
            self.replays.act(st, action)
        return ""

    def _drain_bound(self, lst: Listener, sock: zmq.Socket[bytes], now: float) -> None:
        """What waits on a bound endpoint (or its relay's inbox), each message to its stream."""
        wall = self._wall()
        recv, more, take, routes = sock.recv, sock.get, self._take, lst.routes
        n = 0
        for _ in range(DRAIN_LIMIT):
            try:
                frames = [recv(zmq.NOBLOCK)]
            except zmq.Again:
                break
            while more(_RCVMORE):
                frames.append(recv(zmq.NOBLOCK))
            n += 1
            st = routes.get(frames[0])
            if st is None:
                st = self._route(lst, frames[0])
                if st is None:
                    continue
            reason = take(st, frames, now, wall)
            link = st.link
            if link is not None:
                if reason:
                    link.on_data(0, 1, reason, frames, now, wall)
                else:
                    link.on_data(1, 0, "", (), now, wall)
        self.received_total += n
        lst.messages += n

    def _route(self, lst: Listener, topic: bytes) -> WatchedStream | None:
        """The stream a new topic frame feeds (created for a new pod), or None: skipped."""
        reason = lst.skips.get(topic)
        if reason is None:
            text = topic.decode("utf-8", "replace")
            st: WatchedStream | None = None
            why = ""
            if not lst.template.templated:
                if text.startswith(lst.spec.topic):
                    st = lst.stream
                if st is None:
                    reason, why = (
                        "topic_mismatch",
                        f"topic {text!r} is not under {lst.spec.topic!r}",
                    )
            else:
                spec = lst.pod_spec(text)
                if isinstance(spec, str):
                    reason, why = "topic_mismatch", spec
                else:
                    st = self._streams.get(spec.key) or self._new_pod(lst, spec)
                    if st is None:
                        reason, why = "refused", f"{spec.worker_id}: past max_streams"
            if st is not None:
                lst.route(topic, st)
                return st
            assert reason is not None
            lst.skip(topic, reason, why)
        lst.skipped[reason] = lst.skipped.get(reason, 0) + 1
        return None

    def _new_pod(self, lst: Listener, spec: StreamSpec) -> WatchedStream | None:
        """A stream for a pod seen for the first time (None: refused by max_streams)."""
        key = spec.key
        if len(self._streams) >= self.options.max_streams:
            if key not in self._refused_pods and len(self._refused_pods) < 1 << 16:
                self._refused_pods.add(key)
                self.refused_streams_total += 1
            return None
        st = self._streams[key] = self._new_stream(spec)
        self._pods[key] = lst
        lst.pods.add(key)
        self._link_peers()
        return st

    # --- sockets ------------------------------------------------------------------------------

    def _on_monitor(self, st: WatchedStream, mon: zmq.Socket[bytes], now: float) -> None:
        wall = self._wall()
        while True:
            try:
                msg = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if st.link is not None:
                st.link.on_monitor(int(msg["event"]), int(msg["value"]), now, wall)

    def _open(self, st: WatchedStream) -> None:
        o = self.options
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, o.rcvhwm)
        sock.setsockopt(zmq.RECONNECT_IVL, o.reconnect_ivl_ms)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, o.reconnect_ivl_max_ms)
        sock.setsockopt(zmq.SUBSCRIBE, st.spec.topic.encode())
        mon = sock.get_monitor_socket(MONITOR_EVENTS)
        sock.connect(st.spec.endpoint)
        st.sock, st.monitor = sock, mon
        self._by_sock[sock] = st
        self._by_monitor[mon] = st
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(mon, zmq.POLLIN)

    def _close(self, st: WatchedStream) -> None:
        self.replays.close(st)
        for sock, table in ((st.sock, self._by_sock), (st.monitor, self._by_monitor)):
            if sock is not None:
                table.pop(sock, None)
                self._poller.unregister(sock)
        if st.sock is not None:
            st.sock.disable_monitor()
            st.sock.close(linger=0)
        if st.monitor is not None:
            st.monitor.close(linger=0)
        st.sock = st.monitor = None

    def _apply_specs(
        self, specs: Sequence[StreamSpec], listens: Sequence[ListenSpec] | None = None
    ) -> None:
        wanted = {s.key: s for s in specs}
        for key in [k for k in self._streams if k not in wanted and k not in self._pods]:
            self._drop(self._streams.pop(key))
        live_links = {id(st.link) for st in self._streams.values()}
        self.topic_probes.close_for(lambda link: id(link) in live_links)
        before, self._refused_streams = self._refused_streams, set()
        for key, spec in wanted.items():
            st = self._streams.get(key)
            if st is not None and st.spec == spec:
                continue
            if st is None and len(self._streams) >= self.options.max_streams:
                self._refused_streams.add(key)
                continue
            if st is not None:  # moved (engine restarted on new ports): keep the sequence state
                self._close(st)
                st.spec = spec
                if st.seq is not None:
                    st.seq.replay_enabled = spec.replay_endpoint is not None
                if st.link is not None:
                    health = st.link.health
                    st.link = Link(
                        spec.endpoint, spec.topic, health, self.options.link, bound=spec.bound
                    )
                    health.set("connecting", f"endpoint changed to {spec.endpoint}", self._wall())
            else:
                st = self._streams[key] = self._new_stream(spec)
            if spec.bound:
                continue  # fed by its bound endpoint
            try:
                self._open(st)
            except zmq.ZMQError as exc:  # a bad endpoint must not take the others down
                st.decode_errors["connect"] = st.decode_errors.get("connect", 0) + 1
                log.warning("cannot connect %s: %s", spec.endpoint, exc)
                if st.link is not None:
                    st.link.health.set("connecting", f"cannot connect: {exc}", self._wall())
        for gone in self._mirrors.keys() - {k[0] for k in self._streams}:
            del self._mirrors[gone]  # a worker with no stream left (a deleted pod)
        self.refused_streams_total += len(self._refused_streams - before)  # newly refused
        if listens is not None:
            self._apply_listens(listens)
        self._link_peers()
        if self._refused_streams and not self._warned_refused:
            self._warned_refused = True  # once: the count is in kvobserve_collector_refused_total
            log.warning(
                "watching %d streams, the max_streams cap; %d refused",
                len(self._streams),
                len(self._refused_streams),
            )

    def _new_stream(self, spec: StreamSpec) -> WatchedStream:
        """The state of a stream seen for the first time (its socket is opened by the caller)."""
        seq = None
        if not spec.probe:
            seq = StreamSequencer(
                spec.dp_rank, replay=spec.replay_endpoint is not None, limits=self.options.limits
            )
        st = WatchedStream(spec, seq)
        if seq is not None:
            st.mirror = self._mirrors.setdefault(spec.worker_id, MirrorDetector())
            st.link = new_link(spec, self.options.link, self.events, self._wall())
            st.history = StreamHistory(spec.worker_id, spec.dp_rank, self.events)
            if self.options.analytics is not None:
                cache_stats.attach(seq, self.options.analytics)
            if self.misses is not None:
                curve = None
                if self.curves is not None:
                    curve = self.curves.make(spec.worker_id, spec.dp_rank, spec.engine, seq)
                self.misses.attach(spec.worker_id, spec.dp_rank, spec.engine, seq, curve)
        return st

    def _drop(self, st: WatchedStream) -> None:
        """A stream no longer watched: its sockets closed, its batches no longer sampled."""
        self._close(st)
        self._untap(st)

    def _untap(self, st: WatchedStream) -> None:
        if self.misses is not None and st.seq is not None:
            self.misses.detach(st.spec.worker_id, st.spec.dp_rank, st.seq)
        if self.curves is not None:
            self.curves.drop(st.spec.worker_id, st.spec.dp_rank)

    def _link_peers(self) -> None:
        if self.options.analytics is not None:
            cache_stats.link_peers(
                (k[0], st.seq) for k, st in self._streams.items() if st.seq is not None
            )

    # --- bound endpoints (bind mode) ------------------------------------------------------------

    def _apply_listens(self, listens: Sequence[ListenSpec]) -> None:
        """Bind exactly `listens`; an endpoint whose spec changed is bound anew."""
        wanted = {x.key: x for x in listens}
        for key, lst in list(self._listeners.items()):
            if wanted.get(key) != lst.spec:
                self._drop_listener(self._listeners.pop(key))
        now, wall = self._clock(), self._wall()
        for key, spec in wanted.items():
            if key in self._listeners:
                continue
            lst = self._listeners[key] = Listener(spec, self.events, wall)
            if not spec.template.templated:
                lst.stream = self._streams.get(key)  # planned with the listener
            self._bind(lst, now, wall)

    def _bind(self, lst: Listener, now: float, wall: float) -> None:
        if lst.spec.relay_to is not None:  # the relay process binds
            relay = self._relay
            if relay is None:
                relay = self._relay = Relay(self._ctx)
            try:
                lst.open_relayed(self._ctx, self.options, relay)
            except Exception as exc:  # no relay process: say so, try again later
                log.exception("cannot start the relay process")
                lst.close(None)
                lst.retry_at = now + self.options.rebind_s
                lst.health.set("bind_failed", f"cannot start the relay process: {exc}", wall)
                return
            self._by_lane[lst.lane or 0] = lst
            if relay.control is not None and relay.control not in self._registered:
                self._registered.add(relay.control)
                self._poller.register(relay.control, zmq.POLLIN)
        elif not lst.open(self._ctx, self.options, now, wall):
            return
        if lst.monitor is not None:
            self._by_lmon[lst.monitor] = lst
            self._poller.register(lst.monitor, zmq.POLLIN)
        assert lst.inbox is not None
        self._by_inbox[lst.inbox] = lst
        self._poller.register(lst.inbox, zmq.POLLIN)

    def _on_relay_status(self, now: float) -> None:
        assert self._relay is not None
        wall = self._wall()
        for lane in self._relay.drain():
            lst = self._by_lane.get(lane)
            st = self._relay.status.get(lane)
            if lst is not None and st is not None:
                lst.on_relay_status(st, now, wall)

    def _unbind(self, lst: Listener) -> None:
        for sock, table in ((lst.inbox, self._by_inbox), (lst.monitor, self._by_lmon)):
            if sock is not None and table.pop(sock, None) is not None:
                self._poller.unregister(sock)
        if lst.lane is not None:
            self._by_lane.pop(lst.lane, None)
        lst.close(self._relay)

    def _forget_relay(self) -> None:
        relay, self._relay = self._relay, None
        if relay is None:
            return
        if relay.control is not None and relay.control in self._registered:
            self._registered.discard(relay.control)
            self._poller.unregister(relay.control)
        relay.stop()

    def _drop_listener(self, lst: Listener) -> None:
        """Unbind, and forget the streams its topics named."""
        self._unbind(lst)
        for key in lst.pods:
            self._forget_pod(key)
        lst.pods.clear()

    def _forget_pod(self, key: tuple[str, int]) -> None:
        st = self._streams.pop(key, None)
        lst = self._pods.pop(key, None)
        if st is not None:
            self.replays.close(st)
            self._untap(st)
        if lst is not None:
            lst.pods.discard(key)
            lst.forget_routes()
        if not any(k[0] == key[0] for k in self._streams):
            self._mirrors.pop(key[0], None)

    def _on_listener_monitor(self, lst: Listener, mon: zmq.Socket[bytes], now: float) -> None:
        wall = self._wall()
        while True:
            try:
                msg = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            lst.on_monitor(int(msg["event"]), int(msg["value"]), now, wall)

    def _tick_listeners(self, now: float, wall: float) -> None:
        """Bind again what failed, name wrong topics, forget pods silent for forget_after_s."""
        forget = self.options.forget_after_s
        relay = self._relay
        if relay is not None and self._by_lane and not relay.alive:  # it died: start it again
            why = f"the relay process ended ({relay.exit_status}); starting it again"
            log.error("%s", why)
            for lst in list(self._by_lane.values()):
                self._unbind(lst)
                lst.health.set("starting", why, wall)
                if lst.relay_health is not None:
                    lst.relay_health.set("connecting", why, wall)
            self._forget_relay()
        for lst in self._listeners.values():
            if lst.inbox is None and now >= lst.retry_at:
                self._bind(lst, now, wall)
            if lst.wrong_topics:
                if lst.stream is not None and lst.stream.link is not None:
                    lst.stream.link.on_probe(lst.wrong_topics, None, now, wall)
                lst.wrong_topics = {}
            for key in [k for k in lst.pods if now - self._streams[k].last_seen > forget]:
                log.info("forgetting %s rank %d: no message for %.0f s", *key, forget)
                self._forget_pod(key)
                self._link_peers()

    def _close_all(self) -> None:
        for st in self._streams.values():
            self._close(st)
        for lst in self._listeners.values():
            self._unbind(lst)
        self._forget_relay()
        self.topic_probes.close_all()
        self.replays.clear()
        while self._calls:
            _, fut = self._calls.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("ingest loop stopped"))

    # --- snapshot -----------------------------------------------------------------------------

    def _build_stats(self, whole: frozenset[str] = frozenset()) -> IngestStats:
        now, wall = self._clock(), self._wall()
        siblings: dict[str, list[StreamSequencer]] = {}
        for (worker_id, _), w in self._streams.items():
            if w.seq is not None:
                siblings.setdefault(worker_id, []).append(w.seq)
        streams: list[StreamStats] = []
        unexpected: list[UnexpectedStream] = []
        refused = {"streams": self.refused_streams_total, "medium_events": 0}
        for st in self._streams.values():
            spec = st.spec
            if st.seq is None:
                active = st.batches > 0 and now - st.last_seen < self.options.unexpected_quiet_s
                unexpected.append(
                    UnexpectedStream(
                        spec.worker_id, spec.dp_rank, spec.endpoint, st.batches, active
                    )
                )
                continue
            if st.link is not None:
                st.link.observe_duplicate(st.seq.duplicate_stream(now), wall)
            if st.history is not None:
                st.history.update(st.seq, st.decode_errors, now, wall)
            s = stream_stats(st, st.seq, now, wall)
            cache_stats.fill_stream(s, st.seq, [q.index for q in siblings[spec.worker_id]], wall)
            if st.link is not None:
                link = st.link
                s.trust_reason = st.seq.trust_reason(now, link.last_data, link.zmq_at is not None)
            streams.append(s)
            refused["medium_events"] += st.seq.index.media_refused_events
        pods: dict[str, list[str]] = {}
        for key, lst in self._pods.items():  # every rank of a pod comes to this collector
            pods.setdefault(lst.spec.worker_id, []).append(key[0])
        whole = whole | {w for ws in pods.values() for w in ws}
        placement: list[WorkerPlacement] = []
        if self._placements is not None:
            placement = self._placements.build(
                (
                    (w.spec.worker_id, w.spec.dp_rank, w.spec.engine, w.seq)
                    for w in self._streams.values()
                    if w.seq is not None
                ),
                whole,
                now,
            )
        refused = {k: v for k, v in refused.items() if v}
        binds: list[BindStats] = [lst.stats() for lst in self._listeners.values()]
        misses = self.misses.deltas(wall - UNTIL_SLACK_S) if self.misses is not None else []
        curves = self.curves.stats(now) if self.curves is not None else []
        return IngestStats(
            streams, unexpected, refused, self.received_total, self.loop_errors, placement,
            binds, {w: sorted(set(ids)) for w, ids in pods.items()}, misses, curves,
        )  # fmt: skip
