"""Render /metrics just before a steady scraper's next request (render-ahead).

Prometheus scrapes a target at a fixed interval. At a few thousand streams a body costs a
render of a few hundred ms on a busy machine, and rendered on request that is the scrape's
latency. So the aggregator notes when each scraper (its address and the body format it asks
for) came. Once two of its intervals in a row agree (within 10%, each at least MIN_INTERVAL_S),
it is steady while each later interval stays within 25% of that one. Its next request is
expected on the schedule through its last few (a request noted late on a busy loop does not
move it), and that body is rendered `lead` before it: twice the last render's wall time plus
0.1 s, at most three quarters of `max_age`.

A request is served a body of its format begun after that scraper's previous request and at
most `max_age` seconds before this one; a body being rendered is waited for; anything else (the
first scrapes, curl, several scrapers behind one address) is rendered on request, as without
this. Cost: one render per expected request, as on request. Effect on the values: at most
`max_age` (typically `lead`) older than the newest snapshots, snapshot ages included. A scraper
that stops is forgotten after three of its intervals; nothing is rendered ahead until some
scraper is steady again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.9  # a scraper every 1 s or more, less its jitter; faster pollers: on request
SERVED = ("ahead", "in_flight", "on_request")  # how requests were answered (RenderAhead.served)


@dataclass(frozen=True, slots=True)
class Format:
    """What a scraper asked for; equal formats share their bodies."""

    content_type: str
    gzip: bool
    openmetrics: bool = field(compare=False)
    encoder: Callable[[Any], bytes] = field(compare=False, repr=False)


@dataclass(slots=True)
class _Scraper:
    fmt: Format
    times: list[float]  # its latest requests (clock seconds), oldest first, up to 4
    seen: float = -math.inf  # when the body it got last was begun
    interval: float = 0.0  # its steady interval; 0.0 until two agree

    @property
    def last(self) -> float:
        """Its latest request."""
        return self.times[-1]

    @property
    def gap(self) -> float:
        """Its latest interval (0.0 after one request)."""
        return self.times[-1] - self.times[-2] if len(self.times) > 1 else 0.0

    def came(self, now: float) -> None:
        """A request at `now`: two intervals within 10% make it steady; a steady one stays so
        while each interval is within 25% of it (a request noted late on a busy loop)."""
        t = self.times = [*self.times[-3:], now]
        gap = self.gap
        if self.interval and abs(gap - self.interval) <= 0.25 * self.interval:
            self.interval = statistics.median([b - a for a, b in itertools.pairwise(t)])
        elif (
            len(t) > 2
            and min(gap, t[-2] - t[-3]) >= MIN_INTERVAL_S
            and (abs(gap - (t[-2] - t[-3])) <= 0.1 * gap)
        ):
            self.interval = gap
            self.times = t[-3:]  # its schedule starts with these
        else:
            self.interval = 0.0

    def expect(self) -> float:
        """Its next request on the schedule through its latest ones: each was noted at or
        after its scheduled time, so the earliest projection is the closest."""
        n = len(self.times)
        return min(t + (n - i) * self.interval for i, t in enumerate(self.times))


class RenderAhead:
    """Bodies per format, rendered on request or ahead of the requests steady scrapers make."""

    def __init__(
        self,
        render: Callable[[Format], Awaitable[bytes]],
        max_age: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_age = max_age
        self.render_s = 0.0  # wall time of the latest render
        self.served = dict.fromkeys(SERVED, 0)
        self._render = render
        self._clock = clock
        self._scrapers: dict[tuple[str, Format], _Scraper] = {}
        self._bodies: dict[Format, tuple[float, bytes]] = {}  # begun at, body
        self._pending: dict[Format, tuple[float, asyncio.Task[bytes]]] = {}
        self._wake = asyncio.Event()

    @property
    def lead(self) -> float:
        """How long before an expected request its body is begun."""
        return min(2 * self.render_s + 0.1, 0.75 * self.max_age)

    async def body(self, peer: str, fmt: Format) -> bytes:
        """The body for one request from `peer`."""
        now = self._clock()
        s = self._scrapers.get((peer, fmt))
        if s is None:
            s = self._scrapers[(peer, fmt)] = _Scraper(fmt, [now])
            since = -math.inf
        else:
            was = s.interval
            since = max(s.last, s.seen)  # newer than its previous request and than what it got
            s.came(now)
            if s.interval and not was and self.max_age > 0:
                log.info(
                    "%s scrapes /metrics every %.1f s (%s%s): rendering ahead of it",
                    peer, s.interval, fmt.content_type, ", gzip" if fmt.gzip else "",
                )  # fmt: skip
        self._wake.set()
        for _ in range(2):  # at most one render per format at a time: an older one finishes first
            pending = self._pending.get(fmt)
            if pending is None:
                break
            if pending[0] > since:
                self.served["in_flight"] += 1
                s.seen = pending[0]
                return await asyncio.shield(pending[1])
            with contextlib.suppress(Exception):
                await asyncio.shield(pending[1])
        hit = self._bodies.get(fmt)
        if hit is not None and hit[0] > since and hit[0] >= now - self.max_age:
            self.served["ahead"] += 1
            s.seen = hit[0]
            return hit[1]
        self.served["on_request"] += 1
        task = self._start(fmt)
        s.seen = self._pending[fmt][0]
        return await asyncio.shield(task)

    def _start(self, fmt: Format) -> asyncio.Task[bytes]:
        """A render of `fmt`, from now."""
        began = self._clock()
        task = asyncio.ensure_future(self._render_one(fmt, began))
        self._pending[fmt] = (began, task)
        return task

    async def _render_one(self, fmt: Format, began: float) -> bytes:
        try:
            body = await self._render(fmt)
        finally:
            if self._pending.get(fmt, (None,))[0] == began:
                del self._pending[fmt]
        self.render_s = self._clock() - began
        self._bodies[fmt] = (began, body)
        return body

    def _due(self, now: float) -> tuple[list[Format], float]:
        """(formats to render now, seconds until the next one is due); forgets stopped scrapers."""
        due: list[Format] = []
        wait = 1.0
        for key, s in list(self._scrapers.items()):
            interval = s.interval
            if now - s.last > 3 * max(interval, s.gap, MIN_INTERVAL_S):
                del self._scrapers[key]
                continue
            if not interval or s.fmt in self._pending or s.fmt in due:
                continue
            expect = s.expect()
            began = self._bodies.get(s.fmt, (-math.inf,))[0]
            if began > max(s.last, s.seen) and began >= expect - self.max_age:
                continue  # begun for its next request (or another scraper's, close enough)
            start = expect - self.lead
            if now >= start:
                due.append(s.fmt)
            else:
                wait = min(wait, start - now)
        wanted = {s.fmt for s in self._scrapers.values()}
        for fmt in [f for f in self._bodies if f not in wanted]:
            del self._bodies[fmt]  # nobody asks for it any more
        return due, wait

    async def run(self) -> None:
        """Render ahead until cancelled."""
        while True:
            due, wait = self._due(self._clock())
            for fmt in due:
                try:
                    await self._start(fmt)
                except Exception:  # a request for it renders again and answers with the error
                    log.exception("rendering /metrics ahead failed")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)
