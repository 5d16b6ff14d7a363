"""The streams of Dynamo event planes: messages in, per-(worker, dp_rank) analysis, snapshot parts.

Owned by the Dynamo ingest thread (sources/dynamo_ingest.py); nothing here does I/O. Every
`kv-events` RouterEvent becomes one KvBatch (`seq = event_id - 1`) for the stream's
StreamSequencer (no replay: the plane has none) and BlockIndex. Streams appear as their events
arrive, up to `max_streams` (more are refused and counted), and are forgotten after
`forget_after_s` without any message. Per stream the envelope `(publisher_id, sequence)` is
tracked too: a sequence jump is a lost message, a publisher that comes back after another one
took over is a second live publisher (duplicate stream). `kv_metrics` (ActiveLoad) and
`forward-pass-metrics` feed the scheduler values of the rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from kvobserve.sources.dynamo_plan import DynamoPlan
from kvobserve.sources.dynamo_state import (
    DynamoOptions,
    DynamoStats,
    DynamoStream,
    Key,
    PlaneState,
    Touched,
    touch,
)
from kvobserve.sources.overlap import rank_overlaps
from kvobserve.sources.plan import StreamSpec
from kvobserve.sources.scheduler import SchedulerValues, merge_values
from kvobserve.sources.stream_state import stream_stats
from kvobserve.wire.dynamo import (
    DynamoMessage,
    decode_active_load,
    decode_fpm,
    decode_nats_message,
    decode_router_events,
    decode_zmq_message,
    to_batches,
)
from kvobserve.wire.dynamo_subject import FPM_TOPIC, KV_EVENTS_TOPIC, KV_METRICS_TOPIC
from kvobserve.wire.errors import WireError
from kvobserve.wire.kv_events import BlockHash
from kvobserve.wire.overlap import RankOverlap
from kvobserve.wire.snapshot import (
    DynamoPlaneStats,
    DynamoStreamStats,
    SchedulerStats,
    WorkerInfo,
)


class DynamoTable:
    """Every stream and scheduler value of the collector's Dynamo planes."""

    def __init__(
        self,
        plans: Sequence[DynamoPlan],
        options: DynamoOptions | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.options = options or DynamoOptions()
        self._clock, self._wall = clock, wall
        self.planes = [PlaneState(p) for p in plans]
        self.streams: dict[Key, DynamoStream] = {}
        self.sched: dict[Key, dict[str, SchedulerValues]] = {}
        self.last_seen: dict[Key, float] = {}  # any message of the key (events, load, FPM)
        self.refused: set[Key] = set()
        self.refused_total = 0
        self.touching: set[int] = set()  # plane indexes with a drift comparison in progress

    # --- messages -----------------------------------------------------------------------------

    def on_nats(self, plane: int, subject: str, body: bytes) -> None:
        """One NATS message of plane `plane`."""
        ps = self.planes[plane]
        ps.messages_total += 1
        try:
            msg = decode_nats_message(subject, body, self.options.max_payload)
            subj = msg.subject
            ns = ps.plan.worker.namespace
            if ns is not None and subj is not None and subj.namespace != ns:
                ps.count("other_namespace")  # a wildcard stream subject: not ours
                return
            self._on_message(ps, msg, ps.plan.shown)
        except WireError as exc:
            ps.count(exc.reason)

    def on_zmq(self, plane: int, endpoint: str, frames: Sequence[bytes]) -> None:
        """One ZMQ direct message from `endpoint`."""
        ps = self.planes[plane]
        ps.messages_total += 1
        try:
            msg = decode_zmq_message(frames, self.options.max_payload)
            self._on_message(ps, msg, endpoint)
        except WireError as exc:
            ps.count(exc.reason)

    def _on_message(self, ps: PlaneState, msg: DynamoMessage, where: str) -> None:
        topic = msg.topic
        now = self._clock()
        if topic == KV_EVENTS_TOPIC:
            self._on_events(ps, msg, where, now)
        elif topic == KV_METRICS_TOPIC:
            load = decode_active_load(msg)
            key = self._key(ps, load.worker_id, load.dp_rank)
            if key is None:
                return
            values: dict[str, float | None] = {}
            bs, cap = ps.plan.worker.block_size, ps.plan.worker.capacity_tokens
            if load.kv_used_blocks is not None and bs and cap:
                values["token_usage_ratio"] = load.kv_used_blocks * bs / cap
            if load.waiting_requests is not None:
                values["queued_requests"] = load.waiting_requests
            self._set(key, "kv_metrics", now, values, cap)
        elif topic == FPM_TOPIC:
            fpm = decode_fpm(msg)
            key = self._key(ps, fpm.worker_id, fpm.dp_rank or 0)
            if key is None:
                return
            s, q = fpm.scheduled_requests, fpm.queued_requests
            running = s.num_prefill_requests + s.num_decode_requests
            queued = q.num_prefill_requests + q.num_decode_requests
            fpm_values: dict[str, float | None] = {
                "running_requests": running,
                "queued_requests": queued,
            }
            self._set(key, "fpm", now, fpm_values, ps.plan.worker.capacity_tokens)
        else:
            ps.count("other_topic")

    def _key(self, ps: PlaneState, dynamo_worker_id: int | str, dp_rank: int) -> Key | None:
        """The stream key of a message, None when another collector keeps that rank."""
        if not ps.plan.keeps(dp_rank):
            ps.not_owned_events += 1
            return None
        return (ps.plan.label(dynamo_worker_id), dp_rank)

    def _set(
        self, key: Key, source: str, now: float, values: dict[str, float | None], cap: int
    ) -> None:
        per = self.sched.get(key)
        if per is None:
            if len(self.sched) >= self.options.max_streams:
                self._refuse(key)
                return
            per = self.sched[key] = {}
        self.last_seen[key] = now
        v = per.get(source)
        if v is None:
            v = per[source] = SchedulerValues(source=source)
        for name, x in values.items():
            if x is not None:
                setattr(v, name, float(x))
        if cap:
            v.max_total_tokens = float(cap)
        v.updated_at = self._wall()

    def _on_events(self, ps: PlaneState, msg: DynamoMessage, where: str, now: float) -> None:
        events = decode_router_events(msg)
        if events.unknown_variants:
            ps.count("unknown_event", events.unknown_variants)
        ms = msg.published_at_ms
        wall = self._wall()
        ts = ms / 1000 if ms is not None else wall
        first: DynamoStream | None = None
        cur: tuple[int, int] | None = None
        st: DynamoStream | None = None
        for ident, batch, raw in to_batches(events, ts, ps.plan.worker.block_size):
            if ident != cur:  # a message nearly always holds one stream: look it up once
                cur = ident
                st = self._stream(ps, ident, where, now)
                if st is None:
                    continue
                st.watched.last_lag = wall - ts
                if first is None:
                    first = st
                    st.header_mismatch += bool(msg.header_mismatch)
            if st is None:
                continue
            sq = st.seq
            if st.touched is not None:
                restarts = sq.restarts
                touch(st, batch.events)
                sq.on_batch(batch, raw, now)
                st.unsettled = st.unsettled or sq.restarts != restarts
            else:
                sq.on_batch(batch, raw, now)  # no replay on this plane: never an action
        if first is not None and msg.publisher_id is not None and msg.sequence is not None:
            first.envelope(msg.publisher_id, msg.sequence, now)

    def _stream(
        self, ps: PlaneState, ident: tuple[int, int], where: str, now: float
    ) -> DynamoStream | None:
        """The stream of (Dynamo worker_id, dp_rank), created if kept and under the cap."""
        key = self._key(ps, *ident)
        if key is None:
            return None
        st = self.streams.get(key)
        if st is None:
            st = self._new_stream(ps, key, ident[0], where)
            if st is None:
                return None
        w = st.watched
        w.last_seen = self.last_seen[key] = now
        if w.spec.endpoint != where:  # ZMQ: a restarted publisher may advertise a new endpoint
            w.spec = replace(w.spec, endpoint=where)
        return st

    def _new_stream(
        self, ps: PlaneState, key: Key, dynamo_worker_id: int, where: str
    ) -> DynamoStream | None:
        if len(self.streams) >= self.options.max_streams:
            self._refuse(key)
            return None
        spec = StreamSpec(key[0], key[1], ps.plan.worker.engine, where, KV_EVENTS_TOPIC)
        st = self.streams[key] = DynamoStream(ps.plan, spec, dynamo_worker_id, self._wall())
        cap = ps.plan.worker.capacity_tokens
        if cap:
            st.watched.capacity = (float(cap), 0.0)  # configured: known before any loss
        if ps.plan.index in self.touching:
            st.touched = set()
        return st

    def _refuse(self, key: Key) -> None:
        if key not in self.refused and len(self.refused) < 1 << 16:
            self.refused.add(key)
            self.refused_total += 1

    # --- drift windows ------------------------------------------------------------------------

    def start_touch(self, plan_index: int) -> None:
        """From now on, note every block the plane's streams store or remove (drift)."""
        self.touching.add(plan_index)
        for st in self.streams.values():
            if st.plan.index == plan_index:
                st.touched, st.unsettled = set(), False

    def end_touch(self, plan_index: int) -> dict[Key, Touched]:
        """Stop noting; per stream: its resident blocks now and what changed meanwhile."""
        self.touching.discard(plan_index)
        out: dict[Key, Touched] = {}
        for key, st in self.streams.items():
            if st.plan.index != plan_index or st.touched is None:
                continue
            sq = st.seq
            out[key] = Touched(
                st.dynamo_worker_id,
                sq.index.resident_hashes(),
                st.touched,
                st.unsettled,
                sq.state_complete and not sq.duplicate_stream(self._clock()),
            )
            st.touched = None
        return out

    # --- snapshot -----------------------------------------------------------------------------

    def expire(self) -> None:
        """Forget streams and scheduler values silent for `forget_after_s`."""
        now, limit = self._clock(), self.options.forget_after_s
        for key in [k for k, t in self.last_seen.items() if now - t > limit]:
            st = self.streams.get(key)
            if st is not None and st.touched is not None:
                continue  # a drift comparison is using it
            del self.last_seen[key]
            self.streams.pop(key, None)
            self.sched.pop(key, None)

    def _update_connected(self, key: Key, st: DynamoStream, now: float) -> float:
        """Update whether the stream counts as connected now; returns its silence in seconds."""
        w = st.watched
        age = now - self.last_seen.get(key, w.last_seen)
        ps = self.planes[st.plan.index]
        w.connected = w.spec.endpoint in ps.connected and age < self.options.quiet_s
        return age

    def overlap(
        self, hashes: list[BlockHash], workers: frozenset[str] | None = None
    ) -> list[RankOverlap]:
        """For each stream of `workers` (None: all), the leading blocks of `hashes` it holds."""
        now = self._clock()
        mine = [
            (key, st) for key, st in self.streams.items() if workers is None or key[0] in workers
        ]
        for key, st in mine:
            self._update_connected(key, st, now)
        return rank_overlaps(((k[0], k[1], st.seq, st.watched.connected) for k, st in mine), hashes)

    def stats(self) -> DynamoStats:
        """Everything the collector's snapshot takes from the Dynamo planes."""
        self.expire()
        now = self._clock()
        out = DynamoStats([], [], [], [], [], self.refused_total)
        ranks: dict[str, set[int]] = {}
        plan_of: dict[str, DynamoPlan] = {}
        for key, st in sorted(self.streams.items()):
            w, sq = st.watched, st.seq
            age = self._update_connected(key, st, now)
            out.streams.append(stream_stats(w, sq, now))
            out.dynamo.append(
                DynamoStreamStats(
                    key[0],
                    key[1],
                    st.dynamo_worker_id,
                    st.pid,
                    st.pids_seen,
                    st.env_gaps,
                    st.env_missed,
                    st.env_dups,
                    st.header_mismatch,
                    last_message_age_s=round(age, 3),
                )
            )
            ranks.setdefault(key[0], set()).add(key[1])
            plan_of[key[0]] = st.plan
        for key, per in sorted(self.sched.items()):
            ranks.setdefault(key[0], set()).add(key[1])
            plan_of.setdefault(key[0], self._plan_of(key[0]))
            v = merge_values({key[1]: x} for x in per.values())[key[1]]
            out.scheduler.append(
                SchedulerStats(
                    key[0], key[1], v.source, v.running_requests, v.queued_requests,
                    v.token_usage_ratio, v.cache_hit_ratio, v.max_total_tokens, v.updated_at,
                )
            )  # fmt: skip
        for label, seen in sorted(ranks.items()):
            plan = plan_of[label]
            cfg = plan.worker
            owned = seen | set(plan.owned or ())
            size = max(cfg.dp_size or 0, max(owned) + 1)
            out.workers.append(
                WorkerInfo(label, cfg.engine, size, sorted(owned), 0 in owned, cfg.capacity_tokens)
            )
        for ps in self.planes:
            out.planes.append(
                DynamoPlaneStats(
                    ps.plan.worker.id, ps.plan.event_plane, ps.plan.shown, bool(ps.connected),
                    ps.messages_total, dict(ps.errors), ps.not_owned_events,
                )
            )  # fmt: skip
        return out

    def _plan_of(self, label: str) -> DynamoPlan:
        prefix = label.partition("/")[0]
        return next(ps.plan for ps in self.planes if ps.plan.worker.id == prefix)
