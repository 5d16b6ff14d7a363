"""The stream core of one collector: every watched stream's state in every receiving mode, sans-I/O.

Connect mode (a SUB per publisher that binds), bind mode (endpoints this collector binds, one
stream per endpoint or one per pod a topic template names: sources/bind.py), bind mode with a
relay (the relay process binds and forwards first: sources/relay.py) and Kubernetes pods (each
pod's stream planned by sources/plan.py, connected as in connect mode) all keep their streams
here: the plan applied (`apply`), the messages decoded and handed to each stream's sequencer,
replay bookkeeping (sources/replays.py), the tail checks of idle streams and the joins of idle
publishers, topic probes (sources/topic_probe.py), each SUB's connection state (sources/link.py),
bound endpoints and the pods their topics name, caps and refusals. The core opens no socket and
reads no clock: inputs carry `now` (monotonic) and `wall`, and every input may append socket
actions (sources/ingest_actions.py) to `out`, which the shell that owns the sockets
(sources/kv_stream.py) carries out and reports back on. Every guarantee at the sockets is
therefore a test of this class with a fake clock and the engines' bytes
(tests/unit/test_stream_core*.py). sources/ingest_stats.py builds the snapshot from it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from kvobserve.analysis.actions import CancelReplay, RequestReplay
from kvobserve.analysis.checkpoint import restore_index
from kvobserve.analysis.mirror import MirrorDetector
from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.sources import cache_stats
from kvobserve.sources.bind import Listener
from kvobserve.sources.capacity_stats import RankCurves, WorkerCurve
from kvobserve.sources.ingest_actions import (
    Bind,
    Connect,
    Disconnect,
    Restore,
    SocketAction,
    Unbind,
)
from kvobserve.sources.ingest_options import IngestOptions
from kvobserve.sources.link import Link
from kvobserve.sources.miss_stats import MissSamplers
from kvobserve.sources.plan import ListenSpec, StreamSpec
from kvobserve.sources.replays import ReplayQueue
from kvobserve.sources.stream_events import RecentEvents, StreamHistory
from kvobserve.sources.stream_state import WatchedStream, new_link
from kvobserve.sources.topic_probe import TopicProbes
from kvobserve.wire.checkpoint import StreamCheckpoint
from kvobserve.wire.errors import WireError
from kvobserve.wire.kv_events import decode_message
from kvobserve.wire.replay import decode_replay_message

log = logging.getLogger(__name__)
Key = tuple[str, int]
LINK_TICK_S = 1.0  # connection states, tail checks, bound endpoints: once a second is plenty


def count_bad(st: WatchedStream, reason: str, seq_frame: bytes) -> None:
    """Count one message that did not decode, once per seq whether live or replay saw it first.

    The replay ring returns the live bytes, so the same bad batch arrives on both paths.
    """
    if len(seq_frame) == 8:
        seq = int.from_bytes(seq_frame, "big")
        if seq in st.bad_seqs:
            return
        st.bad_seqs.append(seq)
    st.decode_errors[reason] = st.decode_errors.get(reason, 0) + 1


class StreamTable:
    """Every stream of one collector and what its sockets should do (see the module doc)."""

    def __init__(
        self,
        options: IngestOptions | None = None,
        *,
        events: RecentEvents | None = None,
        pools: Mapping[str, str] | None = None,
        fingerprint: Callable[[str], str] | None = None,
        curves: Mapping[str, WorkerCurve] | None = None,
    ) -> None:
        self.options = o = options or IngestOptions()
        # checkpoints (docs/reliability.md): worker_id -> the fingerprint of its config, which a
        # checkpoint must carry to be restored; None: no checkpoints
        self.fingerprint = fingerprint
        self.events = events if events is not None else RecentEvents()
        self.out: list[SocketAction] = []  # socket actions for the shell, in order
        self.streams: dict[Key, WatchedStream] = {}
        self.listeners: dict[Key, Listener] = {}
        self.pods: dict[Key, Listener] = {}  # streams named by a topic template -> their endpoint
        self.replays = ReplayQueue(o.max_concurrent_replays, self.out)
        self.probes = TopicProbes(self.out)
        self._mirrors: dict[str, MirrorDetector] = {}
        self._refused_pods: set[Key] = set()
        self._refused_streams: set[Key] = set()  # refused by the last plan
        self.refused_streams_total = 0
        self._warned_refused = False
        self.received_total = 0
        self._next_link_tick = 0.0
        a = o.analytics
        self.placements = cache_stats.Placements(a) if a is not None else None
        # the miss split (sources/miss_stats.py): [[worker]] id -> its pool; with the analytics
        self.misses = MissSamplers(pools or {}) if a is not None else None
        # the capacity curves (sources/capacity_stats.py), fed by the miss split's samplers
        c = o.curve
        self.curves = RankCurves(c, curves or {}) if a is not None and c is not None else None

    def take_actions(self) -> list[SocketAction]:
        """The socket actions asked for since the last call, oldest first."""
        if not self.out:
            return []
        got = self.out[:]
        self.out.clear()
        return got

    # --- the plan ---------------------------------------------------------------------------------

    def apply(
        self,
        specs: Sequence[StreamSpec],
        listens: Sequence[ListenSpec] | None,
        now: float,
        wall: float,
    ) -> None:
        """Watch exactly `specs` and bind exactly `listens` (None: as now) from now on; streams
        whose spec did not change keep their state, and so does a stream whose endpoint moved
        (an engine restarted on new ports)."""
        wanted = {s.key: s for s in specs}
        for key in [k for k in self.streams if k not in wanted and k not in self.pods]:
            self._drop(self.streams.pop(key))
        live = set(self.streams.values())
        self.probes.close_for(lambda st: st in live)
        before, self._refused_streams = self._refused_streams, set()
        for key, spec in wanted.items():
            st = self.streams.get(key)
            if st is not None and st.spec == spec:
                continue
            if st is None and len(self.streams) >= self.options.max_streams:
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
                    health.set("connecting", f"endpoint changed to {spec.endpoint}", wall)
            else:
                st = self.streams[key] = self._new_stream(spec, wall)
            if not spec.bound:  # else fed by its bound endpoint
                self._open(st)
        for gone in self._mirrors.keys() - {k[0] for k in self.streams}:
            del self._mirrors[gone]  # a worker with no stream left (a deleted pod)
        self.refused_streams_total += len(self._refused_streams - before)  # newly refused
        if listens is not None:
            self._apply_listens(listens, now, wall)
        self._link_peers()
        if self._refused_streams and not self._warned_refused:
            self._warned_refused = True  # once: the count is in kvobserve_collector_refused_total
            log.warning(
                "watching %d streams, the max_streams cap; %d refused",
                len(self.streams),
                len(self._refused_streams),
            )

    def _new_stream(self, spec: StreamSpec, wall: float) -> WatchedStream:
        """The state of a stream seen for the first time (no socket yet)."""
        seq = None
        if not spec.probe:
            seq = StreamSequencer(
                spec.dp_rank, replay=spec.replay_endpoint is not None, limits=self.options.limits
            )
        st = WatchedStream(spec, seq, wall)
        if seq is not None:
            st.mirror = self._mirrors.setdefault(spec.worker_id, MirrorDetector())
            st.link = new_link(spec, self.options.link, self.events, wall)
            st.history = StreamHistory(spec.worker_id, spec.dp_rank, self.events)
            if self.options.analytics is not None:
                cache_stats.attach(seq, self.options.analytics)
            if self.misses is not None:
                curve = None
                if self.curves is not None:
                    curve = self.curves.make(spec.worker_id, spec.dp_rank, spec.engine, seq)
                self.misses.attach(spec.worker_id, spec.dp_rank, spec.engine, seq, curve)
            if self.fingerprint is not None:
                st.config = self.fingerprint(spec.worker_id)
                if seq.replay_enabled:  # only its ring can confirm a checkpoint
                    self.out.append(Restore(st))
        return st

    def _open(self, st: WatchedStream) -> None:
        st.open = True
        self.out.append(Connect(st))

    def _close(self, st: WatchedStream) -> None:
        """Close what the stream has open: its replay, its SUB."""
        self.replays.end(st)
        if st.open:
            st.open = False
            self.out.append(Disconnect(st))

    def _drop(self, st: WatchedStream) -> None:
        """A stream no longer watched: its sockets closed, its batches no longer sampled."""
        self._close(st)
        self.replays.forget(st)
        self._untap(st)

    def _untap(self, st: WatchedStream) -> None:
        if self.misses is not None and st.seq is not None:
            self.misses.detach(st.spec.worker_id, st.spec.dp_rank, st.seq)
        if self.curves is not None:
            self.curves.drop(st.spec.worker_id, st.spec.dp_rank)

    def _link_peers(self) -> None:
        if self.options.analytics is not None:
            cache_stats.link_peers(
                (k[0], st.seq) for k, st in self.streams.items() if st.seq is not None
            )

    # --- what the shell reports -------------------------------------------------------------------

    def restored(
        self, st: WatchedStream, ck: StreamCheckpoint | None, now: float, wall: float
    ) -> None:
        """The shell's answer to `Restore`: the stream's checkpoint (None: none it can trust).
        Its index is filled and the ring is asked from the checkpoint's seq (`resume`)."""
        sq = st.seq
        last = ck.last_seq if ck is not None else None
        if ck is None or last is None or sq is None or sq.last_seq is not None:
            return  # nothing to resume, or batches were applied first
        if not sq.replay_enabled:
            return
        n = restore_index(ck, sq.index)
        ask = sq.resume(last, ck.anchor, (ck.trust_state, ck.trust_reason), now)
        if ask is not None:
            self.replays.act(st, ask)
        spec = st.spec
        msg = f"restored {n} blocks from its checkpoint at seq {last}; asking its ring"
        log.info("stream %s rank %d: %s", spec.worker_id, spec.dp_rank, msg)
        self.events.add("checkpoint", msg, worker_id=spec.worker_id, dp_rank=spec.dp_rank, at=wall)

    def checkpointables(self) -> Iterator[WatchedStream]:
        """The streams a checkpoint may be written of (with a sequencer)."""
        return (st for st in self.streams.values() if st.seq is not None and st.config)

    def connect_failed(self, st: WatchedStream, why: str, wall: float) -> None:
        """The stream's endpoint could not be connected (a bad endpoint); the others go on."""
        st.open = False
        st.decode_errors["connect"] = st.decode_errors.get("connect", 0) + 1
        log.warning("cannot connect %s: %s", st.spec.endpoint, why)
        if st.link is not None:
            st.link.health.set("connecting", f"cannot connect: {why}", wall)

    def on_monitor(
        self, st: WatchedStream, event: int, value: int, now: float, wall: float
    ) -> None:
        """One event of the stream's SUB monitor."""
        if st.link is not None:
            st.link.on_monitor(event, value, now, wall)

    def take(self, st: WatchedStream, frames: list[bytes], now: float, wall: float) -> str:
        """One message of `st`: decoded and handed to its sequencer; "" or why it did not decode.
        The hot path: the shell calls it per message, then `drained` once per drain."""
        st.last_seen = now
        try:
            batch = decode_message(frames, self.options.max_payload)
        except WireError as exc:
            count_bad(st, exc.reason, frames[1] if len(frames) == 3 else b"")
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
            st.mirror.observe(seq, (batch.seq, batch.ts, hash(payload)), now)
        action = seq.on_batch(batch, payload, now)
        if action is not None:
            self.replays.act(st, action)
        return ""

    def drained(
        self,
        st: WatchedStream,
        good: int,
        bad: int,
        bad_reason: str,
        bad_frames: Sequence[bytes],
        now: float,
        wall: float,
    ) -> None:
        """What one drain of the stream's SUB delivered: `good` decoded, `bad` did not."""
        self.received_total += good + bad
        if st.link is not None and (good or bad):
            st.link.on_data(good, bad, bad_reason, bad_frames, now, wall)

    def on_replay_message(self, st: WatchedStream, frames: list[bytes], now: float) -> bool:
        """One message of the stream's replay DEALER; False once the replay is over (the shell
        stops reading it: its EndReplay is in the outbox)."""
        got = self.replays.in_flight.get(st)
        if got is None or st.seq is None:
            return False
        replay_id, sq = got[0], st.seq
        try:
            batch = decode_replay_message(frames, st.spec.topic, self.options.max_payload)
        except WireError as exc:
            count_bad(st, exc.reason, frames[-2] if len(frames) in (3, 4) else b"")
            return True
        if batch is None:  # end marker; holes younger than the reply are asked for anew
            self.replays.end(st)
            again = sq.on_replay_end(replay_id, "ok", now)
            if again is not None:
                self.replays.act(st, again)
            return False
        action = sq.on_replay_batch(replay_id, batch, frames[-1], now)
        if action is not None:  # a tail check found a restarted publisher
            self.replays.act(st, action)
            return False
        if sq.replay_in_flight != replay_id:  # hole filled, or given up
            self.replays.end(st)
            return False
        return True

    def replay_failed(self, st: WatchedStream) -> None:
        """The replay request could not be sent (a bad replay endpoint)."""
        got = self.replays.in_flight.get(st)
        if got is not None and st.seq is not None:
            self.replays.end(st)
            st.seq.on_replay_end(got[0], "error")

    def on_probe_message(self, st: WatchedStream, frames: list[bytes]) -> None:
        """One message the stream's topic probe received."""
        self.probes.on_message(st, frames)

    def probe_failed(self, st: WatchedStream) -> None:
        """The topic probe could not be opened."""
        self.probes.failed(st)

    # --- bound endpoints (bind mode) --------------------------------------------------------------

    def _apply_listens(self, listens: Sequence[ListenSpec], now: float, wall: float) -> None:
        """Bind exactly `listens`; an endpoint whose spec changed is bound anew."""
        wanted = {x.key: x for x in listens}
        for key, lst in list(self.listeners.items()):
            if wanted.get(key) != lst.spec:
                self._drop_listener(self.listeners.pop(key))
        for key, spec in wanted.items():
            if key in self.listeners:
                continue
            lst = self.listeners[key] = Listener(spec, self.events, wall)
            if not spec.template.templated:
                lst.stream = self.streams.get(key)  # planned with the listener
            self.out.append(Bind(lst))

    def bound(self, lst: Listener, error: str | None, now: float, wall: float) -> None:
        """The shell's answer to `Bind`: bound (None) or why not (tried again after rebind_s)."""
        lst.on_bound(error, self.options.rebind_s, now, wall)

    def on_bound_monitor(
        self, lst: Listener, event: int, value: int, peer: str, now: float, wall: float
    ) -> None:
        """One event of a bound SUB's monitor (`peer`: the accepted connection's address)."""
        lst.on_monitor(event, value, peer, now, wall)

    def on_relay_status(
        self, lst: Listener, status: dict[str, Any], now: float, wall: float
    ) -> None:
        """A status of the relay process about `lst`'s lane."""
        lst.on_relay_status(status, now, wall)

    def relay_ended(self, why: str, now: float, wall: float) -> None:
        """The relay process ended (the shell closed what it had of it): its endpoints are bound
        again, by a new process."""
        log.error("%s", why)
        for lst in self.listeners.values():
            if lst.spec.relay_to is not None and lst.bound:
                lst.unbound("starting", why, now, wall)

    def route(self, lst: Listener, topic: bytes, source: int | None, now: float,
              wall: float) -> WatchedStream | None:  # fmt: skip
        """The stream a topic frame not routed yet feeds (created for a new pod), or None:
        skipped. `source`: the connection the message came on (None: the shell cannot tell)."""
        reason = lst.skips.get(topic)
        if reason is None:
            text = topic.decode("utf-8", "replace")
            st: WatchedStream | None = None
            why = ""
            if not lst.template.templated:
                if not text.startswith(lst.spec.topic):
                    reason = "topic_mismatch"
                    why = f"topic {text!r} is not under {lst.spec.topic!r}"
                elif lst.stream is None:  # its stream was refused by the plan
                    reason, why = "refused", f"{lst.spec.worker_id}: past max_streams"
                else:
                    st = lst.stream
            else:
                spec = lst.pod_spec(text)
                if isinstance(spec, str):
                    reason, why = "topic_mismatch", spec
                else:
                    st = self.streams.get(spec.key) or self._new_pod(lst, spec, wall)
                    if st is None:
                        reason, why = "refused", f"{spec.worker_id}: past max_streams"
            if st is not None:
                lst.route(topic, st)
                if lst.template.templated:
                    if source is None:
                        source = lst.pending_sources.pop(topic, None)
                    lst.learn_source(st, source, now, wall)
                return st
            assert reason is not None
            lst.skip(topic, reason, why)
        lst.skipped[reason] = lst.skipped.get(reason, 0) + 1
        return None

    def take_bound(self, st: WatchedStream, frames: list[bytes], now: float, wall: float) -> None:
        """One message a bound endpoint routed to `st`."""
        reason = self.take(st, frames, now, wall)
        link = st.link
        if link is not None:
            if reason:
                link.on_data(0, 1, reason, frames, now, wall)
            else:
                link.on_data(1, 0, "", (), now, wall)

    def bound_drained(self, lst: Listener, n: int) -> None:
        """`n` messages were read off the endpoint in one drain."""
        self.received_total += n
        lst.messages += n

    def _new_pod(self, lst: Listener, spec: StreamSpec, wall: float) -> WatchedStream | None:
        """A stream for a pod seen for the first time (None: refused by max_streams)."""
        key = spec.key
        if len(self.streams) >= self.options.max_streams:
            if key not in self._refused_pods and len(self._refused_pods) < 1 << 16:
                self._refused_pods.add(key)
                self.refused_streams_total += 1
            return None
        st = self.streams[key] = self._new_stream(spec, wall)
        self.pods[key] = lst
        lst.pods.add(key)
        self._link_peers()
        return st

    def _drop_listener(self, lst: Listener) -> None:
        """Unbind, and forget the streams its topics named."""
        if lst.bound:
            lst.bound = False
        self.out.append(Unbind(lst))
        for key in list(lst.pods):
            self._forget_pod(key)
        lst.pods.clear()

    def _forget_pod(self, key: Key) -> None:
        st = self.streams.pop(key, None)
        lst = self.pods.pop(key, None)
        if st is not None:
            self.replays.forget(st)
            self._untap(st)
        if lst is not None:
            lst.pods.discard(key)
            lst.forget_routes()
        if not any(k[0] == key[0] for k in self.streams):
            self._mirrors.pop(key[0], None)

    # --- time -------------------------------------------------------------------------------------

    def tick(self, now: float, wall: float) -> None:
        """Every turn of the shell: replay timeouts and restart confirmations, queued replays;
        once a second, connection states, tail checks and joins, probes, bound endpoints."""
        act = self.replays.act
        for st in self.streams.values():
            if st.seq is not None:
                action = st.seq.expire(now)
                if action is not None:
                    act(st, action)
        self.replays.start_queued()
        if now >= self._next_link_tick:
            self._next_link_tick = now + LINK_TICK_S
            self._tick_links(now, wall)

    def _tick_links(self, now: float, wall: float) -> None:
        self.probes.expire(now, wall)
        self._tick_listeners(now, wall)
        act = self.replays.act
        for st in self.streams.values():
            link, sq = st.link, st.seq
            if link is None or sq is None:
                continue
            link.tick(now, wall)
            last, connected = link.last_data, link.zmq_at
            ask: RequestReplay | CancelReplay | None = None
            if connected is None:
                pass
            elif last is None and sq.last_seq is None:
                # connected and nothing received: an idle publisher's ring is asked from 0
                ask = sq.check_join(now, connected)
            elif last is None:
                # restored from a checkpoint and nothing received live: its anchor is asked for
                # again (a resume whose replay did not answer)
                ask = sq.check_tail(now, connected, reconnected=True)
            else:
                # an idle stream asks for batches after its last one (a lost tail shows no gap);
                # a SUB that connected again since may face another publisher process
                ask = sq.check_tail(now, last, reconnected=connected > last)
            if ask is not None:
                act(st, ask)
            if link.wants_probe(now):
                self.probes.open(st, now)
            elif link.wants_park(now) and st.open:
                self._close(st)
                link.park(now)
            elif link.wants_reopen(now):
                link.reopened()
                self._open(st)

    def _tick_listeners(self, now: float, wall: float) -> None:
        """Bind again what failed, name wrong topics, forget pods silent for forget_after_s."""
        forget = self.options.forget_after_s
        for lst in self.listeners.values():
            if not lst.bound and lst.retry_at is not None and now >= lst.retry_at:
                lst.retry_at = None
                self.out.append(Bind(lst))
            if lst.wrong_topics:
                if lst.stream is not None and lst.stream.link is not None:
                    lst.stream.link.on_probe(lst.wrong_topics, None, now, wall)
                lst.wrong_topics = {}
            for key in [k for k in lst.pods if now - self.streams[k].last_seen > forget]:
                log.info("forgetting %s rank %d: no message for %.0f s", *key, forget)
                self._forget_pod(key)
                self._link_peers()

    def close_all(self) -> None:
        """Every socket closed (shutdown): the actions that close them."""
        for st in self.streams.values():
            self._close(st)
        for lst in self.listeners.values():
            self.out.append(Unbind(lst))
        self.probes.close_all()
        self.replays.clear()

    # --- reading the streams ----------------------------------------------------------------------

    def sequencers(
        self, keep: Callable[[str], bool] | None = None
    ) -> list[tuple[Key, WatchedStream]]:
        """The streams with a sequencer (not probe ports), of workers `keep` accepts."""
        return [
            (k, st)
            for k, st in self.streams.items()
            if st.seq is not None and (keep is None or keep(k[0]))
        ]
