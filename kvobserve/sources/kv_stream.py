"""ZMQ ingest of one collector: a SUB per (worker, dp_rank) stream, replay DEALERs, probe ports.

One thread owns every socket and every StreamSequencer, so the hot path takes no locks: it
drains each readable SUB without blocking, decodes, and hands the batch to the stream's
sequencer. Other threads talk to it only through `call()`, which runs a function in the
ingest thread at its next wake-up (at most `tick_s` later) and returns a Future.
ZMQ reconnects by itself with backoff (RECONNECT_IVL .. RECONNECT_IVL_MAX), so an engine that is
not up yet is simply `up 0` until it is.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvobserve.analysis.mirror import MirrorDetector
from kvobserve.analysis.sequence import (
    DEFAULT_LIMITS,
    CancelReplay,
    RequestReplay,
    SequencerLimits,
    StreamSequencer,
)
from kvobserve.sources.plan import StreamSpec
from kvobserve.wire.errors import WireError
from kvobserve.wire.kv_events import DEFAULT_MAX_PAYLOAD, decode_message
from kvobserve.wire.replay import decode_replay_message, encode_replay_request
from kvobserve.wire.snapshot import Histogram, MediumStats, StreamStats, UnexpectedStream

log = logging.getLogger(__name__)
T = TypeVar("T")

DRAIN_LIMIT = 512  # messages taken from one socket per poll round, so no stream starves others
_RCVMORE = int(zmq.RCVMORE)


@dataclass(frozen=True)
class IngestOptions:
    """Tunables of the ingest loop."""

    max_payload: int = DEFAULT_MAX_PAYLOAD
    max_concurrent_replays: int = 4
    rcvhwm: int = 100_000
    reconnect_ivl_ms: int = 100
    reconnect_ivl_max_ms: int = 5_000
    unexpected_quiet_s: float = 30.0  # a probe port counts as active this long after a batch
    tick_s: float = 0.05
    limits: SequencerLimits = DEFAULT_LIMITS
    max_streams: int = 4096  # streams (incl. probes) per collector: a label cardinality cap


@dataclass(frozen=True)
class IngestStats:
    """What the ingest thread reports for one snapshot."""

    streams: list[StreamStats]
    unexpected: list[UnexpectedStream]
    refused: dict[str, int]  # what a cardinality cap refused: streams, medium_events


class _Stream:
    """State of one watched endpoint, owned by the ingest thread."""

    __slots__ = (
        "bad_seqs",
        "batches",
        "connected",
        "decode_errors",
        "last_lag",
        "last_seen",
        "mirror",
        "monitor",
        "replay",
        "seq",
        "sock",
        "spec",
    )

    def __init__(self, spec: StreamSpec, seq: StreamSequencer | None) -> None:
        self.spec = spec
        self.seq = seq  # None for probe ports
        self.sock: zmq.Socket[bytes] | None = None
        self.monitor: zmq.Socket[bytes] | None = None
        self.replay: tuple[int, zmq.Socket[bytes]] | None = None
        self.mirror: MirrorDetector | None = None
        self.connected = False
        self.decode_errors: dict[str, int] = {}
        self.bad_seqs: deque[int] = deque(maxlen=64)  # seqs that did not decode, live or replay
        self.batches = 0  # probe ports: KV batches seen
        self.last_seen = 0.0  # monotonic time of the last message
        self.last_lag: float | None = None


class IngestLoop:
    """The ingest thread of one collector."""

    def __init__(
        self,
        specs: Sequence[StreamSpec],
        options: IngestOptions | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.options = options or IngestOptions()
        self._clock, self._wall = clock, wall
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._streams: dict[tuple[str, int], _Stream] = {}
        self._mirrors: dict[str, MirrorDetector] = {}
        self._by_sock: dict[zmq.Socket[bytes], _Stream] = {}
        self._by_monitor: dict[zmq.Socket[bytes], _Stream] = {}
        self._by_replay: dict[zmq.Socket[bytes], _Stream] = {}
        self._replay_queue: deque[tuple[_Stream, RequestReplay]] = deque()
        self._poller = zmq.Poller()
        self._calls: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvobserve-ingest", daemon=True)
        self._initial = list(specs)
        self._refused_streams: set[tuple[str, int]] = set()  # refused by the last plan
        self.refused_streams_total = 0
        self._warned_refused = False
        self.received_total = 0
        self.loop_errors = 0

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

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` in the ingest thread; the Future gets its result."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._stop.is_set():
            fut.set_exception(RuntimeError("ingest loop stopped"))
        else:
            self._calls.append((fn, fut))
        return fut

    def stats(self) -> concurrent.futures.Future[IngestStats]:
        """A consistent picture of every stream, built in the ingest thread."""
        return self.call(self._build_stats)

    def set_specs(self, specs: Sequence[StreamSpec]) -> concurrent.futures.Future[None]:
        """Watch exactly `specs` from now on (rediscovery); unchanged streams keep their state."""
        return self.call(lambda: self._apply_specs(specs))

    def sequencer(self, worker_id: str, dp_rank: int) -> StreamSequencer | None:
        """The sequencer of a stream (read it only via `call`, or after `stop`)."""
        st = self._streams.get((worker_id, dp_rank))
        return st.seq if st is not None else None

    # --- the ingest thread --------------------------------------------------------------------

    def _run(self) -> None:
        self._apply_specs(self._initial)
        tick_ms = int(self.options.tick_s * 1000)
        while not self._stop.is_set():
            try:
                ready = self._poller.poll(tick_ms)
                now = self._clock()
                for sock, _ in ready:
                    st = self._by_sock.get(sock)
                    if st is not None:
                        self._drain(st, sock, now)
                    elif (st := self._by_replay.get(sock)) is not None:
                        self._drain_replay(st, sock)
                    elif (st := self._by_monitor.get(sock)) is not None:
                        self._on_monitor(st, sock)
                self._housekeeping(self._clock())
            except zmq.ContextTerminated:
                break
            except Exception:  # one bad turn must not end ingest: count, log, go on
                self.loop_errors += 1
                log.exception("ingest loop error (continuing)")
        self._close_all()

    def _housekeeping(self, now: float) -> None:
        while self._calls:
            fn, fut = self._calls.popleft()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except Exception as exc:
                    fut.set_exception(exc)
        for st in self._streams.values():
            if st.seq is not None:
                action = st.seq.expire(now)
                if action is not None:
                    self._act(st, action)
        self._start_queued_replays()

    def _drain(self, st: _Stream, sock: zmq.Socket[bytes], now: float) -> None:
        seq, opts = st.seq, self.options
        wall = self._wall()
        # recv_multipart() spends ~20% of its time converting RCVMORE to an Enum per frame:
        # the same loop with the plain int option
        recv, more = sock.recv, sock.get
        for _ in range(DRAIN_LIMIT):
            try:
                frames = [recv(zmq.NOBLOCK)]
            except zmq.Again:
                return
            while more(_RCVMORE):
                frames.append(recv(zmq.NOBLOCK))
            self.received_total += 1
            st.last_seen = now
            try:
                batch = decode_message(frames, opts.max_payload)
            except WireError as exc:
                seq_frame = frames[1] if len(frames) == 3 else b""
                _count_bad(st, exc.reason, seq_frame)
                continue
            if batch.unknown_events:
                st.decode_errors["unknown_event"] = (
                    st.decode_errors.get("unknown_event", 0) + batch.unknown_events
                )
            if seq is None:  # a probe port: anything that decodes is an unexpected stream
                st.batches += 1
                continue
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
                self._act(st, action)

    # --- replay -------------------------------------------------------------------------------

    def _act(self, st: _Stream, action: RequestReplay | CancelReplay) -> None:
        if isinstance(action, CancelReplay):
            self._close_replay(st)
            self._replay_queue = deque((s, a) for s, a in self._replay_queue if s is not st)
            return
        self._close_replay(st)
        self._replay_queue = deque((s, a) for s, a in self._replay_queue if s is not st)
        self._replay_queue.append((st, action))
        self._start_queued_replays()

    def _start_queued_replays(self) -> None:
        while self._replay_queue and len(self._by_replay) < self.options.max_concurrent_replays:
            st, req = self._replay_queue.popleft()
            if st.seq is None or st.seq.replay_in_flight != req.replay_id:
                continue  # superseded or timed out while queued
            endpoint = st.spec.replay_endpoint
            if endpoint is None:
                st.seq.on_replay_end(req.replay_id, "error")
                continue
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)  # a replay may be up to buffer_steps batches at once
            try:
                sock.connect(endpoint)
                sock.send_multipart(encode_replay_request(req.start_seq), zmq.NOBLOCK)
            except zmq.ZMQError:
                sock.close(linger=0)
                st.seq.on_replay_end(req.replay_id, "error")
                continue
            st.replay = (req.replay_id, sock)
            self._by_replay[sock] = st
            self._poller.register(sock, zmq.POLLIN)

    def _drain_replay(self, st: _Stream, sock: zmq.Socket[bytes]) -> None:
        if st.replay is None or st.seq is None:
            return
        replay_id = st.replay[0]
        for _ in range(DRAIN_LIMIT):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                batch = decode_replay_message(frames, st.spec.topic, self.options.max_payload)
            except WireError as exc:
                _count_bad(st, exc.reason, frames[-2] if len(frames) in (3, 4) else b"")
                continue
            if batch is None:  # end marker; holes younger than the reply are asked for anew
                self._close_replay(st)
                action = st.seq.on_replay_end(replay_id, "ok", self._clock())
                if action is not None:
                    self._act(st, action)
                return
            st.seq.on_replay_batch(replay_id, batch)
            if st.seq.replay_in_flight != replay_id:  # hole filled, or given up
                self._close_replay(st)
                return

    def _close_replay(self, st: _Stream) -> None:
        if st.replay is None:
            return
        sock = st.replay[1]
        st.replay = None
        self._by_replay.pop(sock, None)
        self._poller.unregister(sock)
        sock.close(linger=0)

    # --- sockets ------------------------------------------------------------------------------

    def _on_monitor(self, st: _Stream, mon: zmq.Socket[bytes]) -> None:
        while True:
            try:
                msg = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if msg["event"] == zmq.EVENT_CONNECTED:
                st.connected = True
            elif msg["event"] in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                st.connected = False

    def _open(self, st: _Stream) -> None:
        o = self.options
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, o.rcvhwm)
        sock.setsockopt(zmq.RECONNECT_IVL, o.reconnect_ivl_ms)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, o.reconnect_ivl_max_ms)
        sock.setsockopt(zmq.SUBSCRIBE, st.spec.topic.encode())
        mon = sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
        )
        sock.connect(st.spec.endpoint)
        st.sock, st.monitor = sock, mon
        self._by_sock[sock] = st
        self._by_monitor[mon] = st
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(mon, zmq.POLLIN)

    def _close(self, st: _Stream) -> None:
        self._close_replay(st)
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
        st.connected = False

    def _apply_specs(self, specs: Sequence[StreamSpec]) -> None:
        wanted = {s.key: s for s in specs}
        for key in [k for k in self._streams if k not in wanted]:
            self._close(self._streams.pop(key))
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
            else:
                seq = None
                if not spec.probe:
                    seq = StreamSequencer(
                        spec.dp_rank,
                        replay=spec.replay_endpoint is not None,
                        limits=self.options.limits,
                    )
                st = self._streams[key] = _Stream(spec, seq)
                if seq is not None:
                    st.mirror = self._mirrors.setdefault(spec.worker_id, MirrorDetector())
            try:
                self._open(st)
            except zmq.ZMQError as exc:  # a bad endpoint must not take the others down
                st.decode_errors["connect"] = st.decode_errors.get("connect", 0) + 1
                log.warning("cannot connect %s: %s", spec.endpoint, exc)
        self.refused_streams_total += len(self._refused_streams - before)  # newly refused
        if self._refused_streams and not self._warned_refused:
            self._warned_refused = True  # once: the count is in kvobserve_collector_refused_total
            log.warning(
                "watching %d streams, the max_streams cap; %d refused",
                len(self._streams),
                len(self._refused_streams),
            )

    def _close_all(self) -> None:
        for st in self._streams.values():
            self._close(st)
        self._replay_queue.clear()
        while self._calls:
            _, fut = self._calls.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("ingest loop stopped"))

    # --- snapshot -----------------------------------------------------------------------------

    def _build_stats(self) -> IngestStats:
        now = self._clock()
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
            streams.append(_stream_stats(st, st.seq, now))
            refused["medium_events"] += st.seq.index.media_refused_events
        return IngestStats(streams, unexpected, {k: v for k, v in refused.items() if v})


def _count_bad(st: _Stream, reason: str, seq_frame: bytes) -> None:
    """Count one message that did not decode, once per seq whether live or replay saw it first.

    The replay ring returns the live bytes, so the same bad batch arrives on both paths.
    """
    if len(seq_frame) == 8:
        seq = int.from_bytes(seq_frame, "big")
        if seq in st.bad_seqs:
            return
        st.bad_seqs.append(seq)
    st.decode_errors[reason] = st.decode_errors.get(reason, 0) + 1


def _stream_stats(st: _Stream, sq: StreamSequencer, now: float) -> StreamStats:
    idx = sq.index
    blocks, tokens = idx.blocks, idx.tokens
    stored, removed, lifetimes = idx.stored_total, idx.removed_total, idx.lifetime
    media = []
    for medium in sorted(blocks):
        h = lifetimes[medium]
        cum = h.cumulative()
        media.append(
            MediumStats(
                medium,
                blocks[medium],
                tokens[medium],
                stored[medium],
                removed[medium],
                Histogram([b for b, _ in cum[:-1]], [c for _, c in cum[:-1]], h.count, h.sum),
            )
        )
    spec = st.spec
    return StreamStats(
        spec.worker_id,
        spec.dp_rank,
        engine=spec.engine,
        endpoint=spec.endpoint,
        topic=spec.topic,
        up=st.connected,
        batches_total=sq.batches_applied,
        events=idx.events_total,
        media=media,
        gaps=sq.gaps,
        missed=sq.missed,
        recovered=sq.recovered,
        lost=sq.lost,
        replay_requests={k: v for k, v in sq.replay_requests.items() if v},
        restarts=sq.restarts,
        duplicate_batches=sq.duplicate_batches,
        duplicate_stream=sq.duplicate_stream(now),
        rank_mismatch_batches=sq.rank_mismatch_batches,
        decode_errors=dict(st.decode_errors),
        state_complete=sq.state_complete,
        last_batch_ts=sq.last_ts or 0.0,
        lag_seconds=st.last_lag,
    )
