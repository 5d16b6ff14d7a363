"""How snapshots and condition events travel from collectors to the aggregator, and how the
aggregator asks the collectors a question (where would a request hit: wire/overlap.py).

Two implementations: `local.LocalBus` (in-process, the embedded default) and `nats.NatsTransport`.
This module imports neither, so the embedded path never loads the NATS client.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "Answer",
    "Coalescer",
    "Handler",
    "Take",
    "Transport",
    "TransportCounters",
    "TransportStatus",
]

# Receives the raw bytes of one message; may be a plain function or a coroutine function.
Handler = Callable[[bytes], Awaitable[None] | None]
# A collector's answer (bytes) to one question (bytes).
Answer = Callable[[bytes], Awaitable[bytes]]
# Takes one answer; True when every answer the asker waits for is in.
Take = Callable[[bytes], bool]


class TransportStatus(enum.Enum):
    """Connection state, as shown on the status page."""

    CONNECTING = "connecting"
    CONNECTED = "connected"
    RECONNECTING = "reconnecting"
    CLOSED = "closed"


@dataclass
class TransportCounters:
    """Cumulative counters of one transport, rendered by the export layer."""

    published: int = 0  # snapshots and events handed to the wire (or the bus)
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> messages not sent
    received: int = 0  # snapshots delivered to the handler
    reconnects: int = 0
    handler_errors: int = 0  # the subscriber's handler raised

    def drop(self, reason: str) -> None:
        """Count one message that could not be sent."""
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


class Transport(Protocol):
    """What collectors publish through and the aggregator subscribes from."""

    status: TransportStatus
    counters: TransportCounters

    async def publish_snapshot(self, collector_id: str, data: bytes, bucket: int = -1) -> None:
        """Send one encoded snapshot part (its shard bucket; -1: not split); never raises for a
        send that fails (it is counted)."""
        ...

    async def publish_event(self, kind: str, data: bytes) -> None:
        """Send one condition transition (JSON); counted like snapshots."""
        ...

    async def subscribe_snapshots(self, handler: Handler) -> None:
        """Call `handler` with the bytes of every snapshot from now on."""
        ...

    async def publish_feedback(self, data: bytes) -> None:
        """Send the aggregator's miss-split feedback (wire/misses.py) to every collector."""
        ...

    async def subscribe_feedback(self, handler: Handler) -> None:
        """Call `handler` (a collector's) with every feedback message from now on."""
        ...

    async def subscribe_events(self, handler: Handler) -> None:
        """Call `handler` with the bytes of every condition event from now on."""
        ...

    async def retained_snapshots(self) -> list[tuple[bytes, float]]:
        """(bytes, wall-clock time stored) of each collector's last kept snapshot; [] if none kept."""
        ...

    async def serve_overlap(self, collector_id: str, answer: Answer) -> None:
        """Answer every overlap question of the cluster with `answer` (a collector)."""
        ...

    async def ask_overlap(self, question: bytes, timeout_s: float, take: Take) -> None:
        """Ask every collector; hand each answer to `take` until it returns True or `timeout_s`
        passed (the asker then knows who did not answer)."""
        ...

    async def close(self) -> None:
        """Stop delivering and release the connection; safe to call twice."""
        ...


class Coalescer:
    """The newest undelivered message per key, fed to `deliver` by one task (its owner cancels it)."""

    # A subscriber slower than its publishers lags by at most one message per key instead of a
    # backlog; each message replaced before delivery is counted as dropped "coalesced".

    def __init__(
        self, deliver: Callable[[bytes], Awaitable[None]], counters: TransportCounters
    ) -> None:
        self._deliver, self._counters = deliver, counters
        self._pending: dict[str, bytes] = {}
        self._delivering = False
        self._wakeup = asyncio.Event()
        self.task = asyncio.create_task(self._run(), name="kvobserve-coalescer")

    @property
    def idle(self) -> bool:
        """Nothing queued or being delivered: a message may be delivered directly, in order."""
        return not self._pending and not self._delivering

    def put(self, key: str, data: bytes) -> None:
        """Queue `data` for `key`, replacing (and counting) an undelivered older one."""
        if key in self._pending:
            self._counters.drop("coalesced")
        self._pending[key] = data
        self._wakeup.set()

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            self._delivering = True
            try:
                while self._pending:
                    await self._deliver(self._pending.pop(next(iter(self._pending))))
            finally:
                self._delivering = False
