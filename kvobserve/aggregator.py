"""The fleet aggregator: snapshots from a transport -> FleetState; condition transitions -> events.

It also keeps the fleet's recent events (MAX_EVENTS): those the collectors report in their
snapshots, each (collector process, seq) once, and its own condition transitions; and it asks
the collectors where a request would hit (`overlap`, docs/cache-analytics.md).

Transport-agnostic: `kvobserve run` and `demo` use it with the in-process bus, `kvobserve
aggregate` with NATS (kvobserve/commands/ wires it to a transport and to the HTTP export).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvobserve.aio import cancel_and_wait
from kvobserve.analysis.conditions import Condition, active, began
from kvobserve.analysis.fleet import FleetState
from kvobserve.analysis.overlap import (
    OverlapAnswer,
    awaited_collectors,
    merge_answers,
    pool_workers,
)
from kvobserve.analysis.views import FleetView, Key
from kvobserve.transport import Transport
from kvobserve.wire.errors import WireError
from kvobserve.wire.kv_events import BlockHash
from kvobserve.wire.misses import encode_feedback
from kvobserve.wire.overlap import OverlapReply, OverlapRequest, decode_reply, encode_overlap
from kvobserve.wire.snapshot import Snapshot, decode_snapshot

log = logging.getLogger(__name__)
SWITCH_INTERVAL_S = 0.001  # tune_runtime()
CHECK_SHARE = 40  # the condition check takes at most 1/40 of a core (a check's CPU x 40 apart)

MAX_EVENTS = 256  # recent events kept for /api/v1/events and the status page
OVERLAP_TIMEOUT_S = 1.0  # how long an overlap question waits for the live collectors' answers


class Aggregator:
    """Applies collector snapshots to a FleetState and announces condition transitions."""

    def __init__(
        self, fleet: FleetState, clock: Callable[[], float] = time.time, interval_s: float = 1.0
    ) -> None:
        self.fleet = fleet
        self.clock = clock
        self.interval_s = interval_s
        self.check_cpu_s = 0.0  # CPU seconds of the latest condition check
        # Self-metrics, read by the export layer.
        self.snapshots_received = 0
        self.decode_errors: dict[str, int] = {}  # WireError reason -> count
        self.transitions_total: dict[str, int] = {}  # "firing" / "resolved" -> count
        self._active: dict[Key, Condition] = {}  # each with `since` = when it began
        self._transport: Transport | None = None
        self.events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)  # oldest first
        # (collector, bucket) -> (start_time, last seq)
        self._event_seq: dict[tuple[str, int], tuple[float, int]] = {}
        self._task: asyncio.Task[None] | None = None
        self._feedback_task: asyncio.Task[None] | None = None

    @property
    def snapshots_applied(self) -> int:
        """Snapshots that replaced a collector's state."""
        return self.fleet.snapshots_applied

    @property
    def snapshots_ignored(self) -> int:
        """Snapshots older than the one held (reordered, replayed or from a dead process)."""
        return self.fleet.snapshots_ignored

    def stats(self) -> dict[str, Any]:
        """The self-metrics as one dict (a copy)."""
        return {
            "snapshots_received": self.snapshots_received,
            "snapshots_applied": self.snapshots_applied,
            "snapshots_ignored": self.snapshots_ignored,
            "decode_errors": dict(self.decode_errors),
            "transitions": dict(self.transitions_total),
        }

    def on_snapshot(self, data: bytes, received: float | None = None) -> None:
        """Decode and apply one snapshot; bad bytes are counted by reason, never raised.

        `received` is when the snapshot reached the bus (for ones read back from a store);
        default now. It is never taken as later than now.
        """
        self.snapshots_received += 1
        try:
            snap = decode_snapshot(data)
        except WireError as exc:
            self.decode_errors[exc.reason] = self.decode_errors.get(exc.reason, 0) + 1
            return
        except UnicodeDecodeError:  # msgspec's error for a str of invalid UTF-8; not msgpack
            self.decode_errors["msgpack"] = self.decode_errors.get("msgpack", 0) + 1
            return
        self.apply(snap, received)

    def apply(self, snap: Snapshot, received: float | None = None) -> None:
        """Apply a decoded snapshot (a collector's own view skips the bytes) and its events."""
        now = self.clock()
        if self.fleet.update(snap, now if received is None else min(received, now)):
            self._take_events(snap)

    def _take_events(self, snap: Snapshot) -> None:
        """The snapshot's events not seen before (a collector restart numbers them anew); each
        part of a collector's snapshot carries its own workers' events (wire/snapshot.py)."""
        info = snap.collector
        key = (info.collector_id, snap.bucket)
        start, last = self._event_seq.get(key, (info.start_time, 0))
        if start != info.start_time:
            last = 0
        for e in sorted(snap.events, key=lambda e: e.seq):
            if e.seq <= last:
                continue
            last = e.seq
            ev: dict[str, Any] = {
                "time": e.time,
                "kind": e.kind,
                "collector": info.collector_id,
                "node_rank": info.node_rank,
                "message": e.message,
            }
            if e.worker_id:
                ev["worker_id"] = e.worker_id
            if e.dp_rank is not None:
                ev["dp_rank"] = e.dp_rank
            if e.first_seq is not None:
                ev["first_seq"], ev["last_seq"] = e.first_seq, e.last_seq
            self.events.append(ev)
        self._event_seq[key] = (info.start_time, last)
        if len(self._event_seq) > 65 * self.fleet.size() + 64:  # forgotten ones
            known = set(self.fleet.collector_ids())
            self._event_seq = {k: v for k, v in self._event_seq.items() if k[0] in known}

    def view(self) -> FleetView:
        """The fleet as of now; its conditions' `since` as the condition checks saw them begin."""
        v = self.fleet.view(self.clock())
        v.began = self.began()
        return v

    def began(self) -> dict[Key, float]:
        """When each active condition began (FleetView.began)."""
        return {k: c.since for k, c in self._active.items()}

    def transitions(self, view: FleetView | list[Condition]) -> list[dict[str, Any]]:
        """Conditions (of a view, or as a list) that started or ended since the last call.

        Each active condition keeps the `since` it began with (analysis/conditions.py `began`):
        the earliest of its evidence and its first check; the time of that check when it has
        no evidence of its start.
        """
        now = self.clock()
        conditions = active(view) if isinstance(view, FleetView) else view
        held = self._active
        current: dict[Key, Condition] = {}
        for c in conditions:
            before = held.get(c.key)
            current[c.key] = began(c, before.since if before is not None else None, now)
        out: list[dict[str, Any]] = []
        for key, c in current.items():
            if key not in self._active:
                out.append(_event(c, "firing", now))
        for key, c in self._active.items():
            if key not in current:
                out.append(_event(c, "resolved", now))
        self._active = current
        return out

    async def check_conditions(self) -> None:
        """One tick: diff the conditions, log and publish the transitions."""
        # Every second: the conditions alone, not a whole view (docs/performance.md).
        cpu = time.thread_time()
        events = self.transitions(self.fleet.conditions(self.clock(), self.began()))
        self.check_cpu_s = time.thread_time() - cpu
        for ev in events:
            self.transitions_total[ev["state"]] = self.transitions_total.get(ev["state"], 0) + 1
            labels = " ".join(f"{k}={v}" for k, v in ev["labels"].items())
            # a resolved condition's description is what it said last, not why it ended
            said = (
                ev["description"]
                if ev["state"] == "firing"
                else f"it last said: {ev['description']}"
            )
            log.info("condition %s: %s %s: %s", ev["state"], ev["kind"], labels, said)
            self.events.append(
                {
                    "time": ev["time"],
                    "kind": "condition",
                    "condition": ev["kind"],
                    "state": ev["state"],
                    "severity": ev["severity"],
                    "labels": ev["labels"],
                    "message": f"{ev['kind']} {ev['state']}: {said}",
                }
            )
            if self._transport is not None:
                await self._transport.publish_event(ev["kind"], json.dumps(ev).encode())

    async def overlap(
        self,
        hashes: list[BlockHash],
        pool: str | None = None,
        timeout_s: float = OVERLAP_TIMEOUT_S,
        via: Transport | None = None,
    ) -> OverlapAnswer:
        """For every rank of the pool, how many leading blocks of `hashes` it holds now, as
        its collector answers (through `via`, default the transport of `start`); PoolError for
        a pool the fleet does not know. Waits for the live collectors of the pool's ranks, at
        most `timeout_s`; a rank whose collector did not answer is listed without a count."""
        transport = via or self._transport
        if transport is None:
            raise RuntimeError("the aggregator has no transport to ask the collectors through")
        view = self.fleet.membership(self.clock())
        workers = pool_workers(view, pool)
        wait = awaited_collectors(view, workers)
        got: dict[str, OverlapReply] = {}

        def take(data: bytes) -> bool:
            try:
                reply = decode_reply(data)
            except WireError as exc:
                self.decode_errors[exc.reason] = self.decode_errors.get(exc.reason, 0) + 1
                return False
            got[reply.collector_id] = reply
            return wait <= got.keys()

        if wait:
            # a named pool asks for its workers only; every worker (None) also gets the ranks
            # of collectors the view does not show yet
            question = OverlapRequest(hashes, workers if pool is not None else None)
            await transport.ask_overlap(encode_overlap(question), timeout_s, take)
        return merge_answers(view, pool, workers, len(hashes), got.values(), timeout_s)

    async def start(self, transport: Transport) -> None:
        """Subscribe live, warm up from retained snapshots, start the condition task."""
        self._transport = transport
        await transport.subscribe_snapshots(self.on_snapshot)
        # Subscribing first leaves no window; a retained snapshot older than a live one is
        # simply ignored by FleetState (seq order).
        retained = await transport.retained_snapshots()
        for data, stored in retained:
            self.on_snapshot(data, stored)
        if retained:
            log.info("warm start: %d retained snapshots read", len(retained))
        self._task = asyncio.create_task(self._tick_loop())
        self._feedback_task = asyncio.create_task(self._feedback_loop())

    async def _tick_loop(self) -> None:
        """Check conditions every interval; a failing tick is logged, the loop goes on."""
        failed = False
        while True:
            try:
                await self.check_conditions()
                failed = False
            except Exception:
                if not failed:  # once per failure streak, not every second
                    log.exception("condition check failed")
                failed = True
            await asyncio.sleep(self.next_check_in())

    async def publish_feedback(self) -> None:
        """Tell the collectors each pool's sample level and the full deltas wanted (the miss
        split, analysis/miss_fleet.py); nothing while no pool is known."""
        fb = self.fleet.misses.feedback(self.clock())
        if fb.levels and self._transport is not None:
            await self._transport.publish_feedback(encode_feedback(fb))

    async def _feedback_loop(self) -> None:
        """The miss split's feedback every interval; a failing one is logged once per streak."""
        failed = False
        while True:
            try:
                await self.publish_feedback()
                failed = False
            except Exception:
                if not failed:
                    log.exception("miss-split feedback failed")
                failed = True
            await asyncio.sleep(self.interval_s)

    def next_check_in(self) -> float:
        """Seconds to the next condition check: the interval, or longer when the last check
        took over 1/CHECK_SHARE of it (thousands of streams: docs/performance.md)."""
        return max(self.interval_s, CHECK_SHARE * self.check_cpu_s)

    async def stop(self) -> None:
        """Stop the condition task; the transport belongs to the caller."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        if self._feedback_task is not None:
            await cancel_and_wait(self._feedback_task)
            self._feedback_task = None


def tune_runtime() -> None:
    """Tune the interpreter for a long-running aggregator (measured: docs/performance.md).

    What was loaded so far lives as long as the process: frozen, it is left out of the full
    passes, which otherwise walk it several times a second. Decoded snapshots are acyclic and
    replaced every interval, so young collections every 50,000 allocations instead of 700 find
    as little garbage for a fraction of the work. /metrics is rendered in a thread while the
    loop serves bodies rendered earlier: a 1 ms switch interval (5 ms by default) lets the loop
    take its turns while a render runs.
    """
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def _event(c: Condition, state: str, now: float) -> dict[str, Any]:
    return {
        "kind": c.kind,
        "state": state,
        "severity": c.severity,
        "labels": dict(c.labels),
        "description": c.description,
        "time": now,
    }
