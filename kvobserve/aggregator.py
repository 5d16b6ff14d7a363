"""The fleet aggregator: snapshots from a transport -> FleetState; condition transitions -> events.

Transport-agnostic: `kvobserve run` and `demo` use it with the in-process bus, `kvobserve
aggregate` with NATS (kvobserve/commands/ wires it to a transport and to the HTTP export).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from kvobserve.aio import cancel_and_wait
from kvobserve.analysis.fleet import Condition, FleetState, FleetView
from kvobserve.transport import Transport
from kvobserve.wire.errors import WireError
from kvobserve.wire.snapshot import decode_snapshot

log = logging.getLogger(__name__)

ConditionKey = tuple[str, tuple[tuple[str, str], ...]]


class Aggregator:
    """Applies collector snapshots to a FleetState and announces condition transitions."""

    def __init__(
        self, fleet: FleetState, clock: Callable[[], float] = time.time, interval_s: float = 1.0
    ) -> None:
        self.fleet = fleet
        self.clock = clock
        self.interval_s = interval_s
        # Self-metrics, read by the export layer.
        self.snapshots_received = 0
        self.decode_errors: dict[str, int] = {}  # WireError reason -> count
        self.transitions_total: dict[str, int] = {}  # "firing" / "resolved" -> count
        self._active: dict[ConditionKey, Condition] = {}
        self._transport: Transport | None = None
        self._task: asyncio.Task[None] | None = None

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
        now = self.clock()
        self.fleet.update(snap, now if received is None else min(received, now))

    def view(self) -> FleetView:
        """The fleet as of now."""
        return self.fleet.view(self.clock())

    def transitions(self, view: FleetView | list[Condition]) -> list[dict[str, Any]]:
        """Conditions (of a view, or as a list) that started or ended since the last call."""
        now = self.clock()
        conditions = view.conditions if isinstance(view, FleetView) else view
        current = {c.key: c for c in conditions}
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
        for ev in self.transitions(self.fleet.conditions(self.clock())):
            self.transitions_total[ev["state"]] = self.transitions_total.get(ev["state"], 0) + 1
            labels = " ".join(f"{k}={v}" for k, v in ev["labels"].items())
            log.info("condition %s: %s %s: %s", ev["state"], ev["kind"], labels, ev["description"])
            if self._transport is not None:
                await self._transport.publish_event(ev["kind"], json.dumps(ev).encode())

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
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        """Stop the condition task; the transport belongs to the caller."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None


def settle_heap() -> None:
    """Tune the cyclic GC for a long-running aggregator (measured: docs/performance.md).

    What was loaded so far lives as long as the process: frozen, it is left out of the full
    passes, which otherwise walk it several times a second. Decoded snapshots are acyclic and
    replaced every interval, so young collections every 50,000 allocations instead of 700 find
    as little garbage for a fraction of the work.
    """
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def _event(c: Condition, state: str, now: float) -> dict[str, Any]:
    return {
        "kind": c.kind,
        "state": state,
        "severity": c.severity,
        "labels": dict(c.labels),
        "description": c.description,
        "time": now,
    }
