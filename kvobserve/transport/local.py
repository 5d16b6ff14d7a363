"""The in-process bus: collectors and the aggregator in one event loop, no network, no NATS."""

from __future__ import annotations

import asyncio
import inspect
import logging

from kvobserve.aio import cancel_and_wait
from kvobserve.transport import Answer, Handler, Take, TransportCounters, TransportStatus

log = logging.getLogger(__name__)


class LocalBus:
    """A Transport whose publish calls every subscribed handler directly, in order."""

    def __init__(self) -> None:
        self.status = TransportStatus.CONNECTED
        self.counters = TransportCounters()
        self._snapshot_handlers: list[Handler] = []
        self._event_handlers: list[Handler] = []
        self._feedback_handlers: list[Handler] = []
        self._answers: dict[str, Answer] = {}  # collector id -> its overlap answer
        self._warned = False

    async def publish_snapshot(self, collector_id: str, data: bytes, bucket: int = -1) -> None:
        """Deliver one snapshot (part) to every snapshot subscriber before returning."""
        if self.status is TransportStatus.CLOSED:
            self.counters.drop("closed")
            return
        self.counters.published += 1
        for h in self._snapshot_handlers:
            if await self._call(h, data):
                self.counters.received += 1

    async def publish_event(self, kind: str, data: bytes) -> None:
        """Deliver one condition event to every event subscriber."""
        if self.status is TransportStatus.CLOSED:
            self.counters.drop("closed")
            return
        self.counters.published += 1
        for h in self._event_handlers:
            await self._call(h, data)

    async def publish_feedback(self, data: bytes) -> None:
        """Deliver the aggregator's miss-split feedback to every collector's handler."""
        if self.status is TransportStatus.CLOSED:
            self.counters.drop("closed")
            return
        for h in self._feedback_handlers:
            await self._call(h, data)

    async def subscribe_feedback(self, handler: Handler) -> None:
        """Add a collector's feedback handler."""
        self._feedback_handlers.append(handler)

    async def subscribe_snapshots(self, handler: Handler) -> None:
        """Add a snapshot subscriber."""
        self._snapshot_handlers.append(handler)

    async def subscribe_events(self, handler: Handler) -> None:
        """Add an event subscriber."""
        self._event_handlers.append(handler)

    async def retained_snapshots(self) -> list[tuple[bytes, float]]:
        """Nothing is retained: in one process the aggregator lives as long as the collectors."""
        return []

    async def serve_overlap(self, collector_id: str, answer: Answer) -> None:
        """Answer the overlap questions asked on this bus with `answer`."""
        self._answers[collector_id] = answer

    async def ask_overlap(self, question: bytes, timeout_s: float, take: Take) -> None:
        """Ask every answering collector at once; hand each answer to `take` as it comes,
        until `take` has what it waits for or `timeout_s` passed."""
        if self.status is TransportStatus.CLOSED:
            return
        pending = {asyncio.ensure_future(a(question)) for a in self._answers.values()}
        try:
            async with asyncio.timeout(timeout_s):
                while pending:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for t in done:
                        if t.exception() is not None:
                            self.counters.handler_errors += 1
                        elif take(t.result()):
                            return
        except TimeoutError:
            pass  # who did not answer in time is the asker's to report
        finally:
            await cancel_and_wait(*pending)

    async def close(self) -> None:
        """Stop delivering; later publishes are counted as dropped."""
        self.status = TransportStatus.CLOSED
        self._snapshot_handlers.clear()
        self._event_handlers.clear()
        self._feedback_handlers.clear()
        self._answers.clear()

    async def _call(self, handler: Handler, data: bytes) -> bool:
        """Run one handler; a failing subscriber must not break the publisher's loop."""
        try:
            result = handler(data)
            if inspect.isawaitable(result):
                await result
        except Exception:
            self.counters.handler_errors += 1
            if not self._warned:  # once: a broken handler would otherwise log every interval
                self._warned = True
                log.warning("local bus: a subscriber's handler raised", exc_info=True)
            return False
        return True
