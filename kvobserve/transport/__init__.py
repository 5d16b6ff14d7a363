"""How snapshots and condition events travel from collectors to the aggregator.

Two implementations: `local.LocalBus` (in-process, the embedded default) and `nats.NatsTransport`.
This module imports neither, so the embedded path never loads the NATS client.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["Handler", "Transport", "TransportCounters", "TransportStatus"]

# Receives the raw bytes of one message; may be a plain function or a coroutine function.
Handler = Callable[[bytes], Awaitable[None] | None]


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

    async def publish_snapshot(self, collector_id: str, data: bytes) -> None:
        """Send one encoded snapshot; never raises for a send that fails (it is counted)."""
        ...

    async def publish_event(self, kind: str, data: bytes) -> None:
        """Send one condition transition (JSON); counted like snapshots."""
        ...

    async def subscribe_snapshots(self, handler: Handler) -> None:
        """Call `handler` with the bytes of every snapshot from now on."""
        ...

    async def subscribe_events(self, handler: Handler) -> None:
        """Call `handler` with the bytes of every condition event from now on."""
        ...

    async def retained_snapshots(self) -> list[tuple[bytes, float]]:
        """(bytes, wall-clock time stored) of each collector's last kept snapshot; [] if none kept."""
        ...

    async def close(self) -> None:
        """Stop delivering and release the connection; safe to call twice."""
        ...
