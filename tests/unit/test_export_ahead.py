"""Render-ahead's schedule (export/ahead.py) on a clock the test moves."""

from __future__ import annotations

import asyncio

from kvobserve.export.ahead import Format, RenderAhead

PLAIN = Format("text/plain; version=0.0.4; charset=utf-8", False, False, bytes)
GZIP = Format("text/plain; version=0.0.4; charset=utf-8", True, False, bytes)


class Clock:
    """Seconds the test sets; each render takes `render_s` of them."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.render_s = 0.3
        self.rendered: list[tuple[Format, float]] = []  # (format, begun at)

    def __call__(self) -> float:
        self.t += 1e-6  # a real clock moves between two readings
        return self.t

    async def render(self, fmt: Format) -> bytes:
        self.rendered.append((fmt, self.t))
        self.t += self.render_s
        return f"body {len(self.rendered)}".encode()


def _ahead(max_age: float = 2.0) -> tuple[RenderAhead, Clock]:
    clock = Clock()
    return RenderAhead(clock.render, max_age, clock), clock


async def _steady(ahead: RenderAhead, clock: Clock, interval: float, n: int, fmt: Format) -> float:
    """`n` requests `interval` apart from one scraper, each rendered on request; the last's time."""
    for i in range(n):
        if i:
            clock.t += interval - clock.render_s
        await ahead.body("10.0.0.9", fmt)
    return clock.t - clock.render_s


async def test_a_steady_scraper_gets_its_body_rendered_ahead() -> None:
    ahead, clock = _ahead()
    last = await _steady(ahead, clock, 15.0, 3, PLAIN)
    assert ahead.served == {"ahead": 0, "in_flight": 0, "on_request": 3}
    lead = ahead.lead
    assert abs(lead - (2 * 0.3 + 0.1)) < 1e-4
    due, wait = ahead._due(last + 15.0 - lead - 0.5)
    assert due == [] and abs(wait - 0.5) < 1e-4  # not yet: the loop sleeps until it is
    due, _ = ahead._due(last + 15.0 - lead + 1e-3)
    assert due == [PLAIN]
    clock.t = last + 15.0 - lead
    await ahead._start(PLAIN)
    assert ahead._due(clock.t)[0] == []  # one render per expected request
    clock.t = last + 15.0
    assert await ahead.body("10.0.0.9", PLAIN) == b"body 4"
    assert ahead.served["ahead"] == 1 and len(clock.rendered) == 4  # no render for the request


async def test_a_scraper_never_gets_the_same_body_twice() -> None:
    ahead, clock = _ahead(max_age=2.0)
    assert await ahead.body("10.0.0.8", PLAIN) == b"body 1"
    clock.t += 0.5
    assert await ahead.body("10.0.0.9", PLAIN) == b"body 1"  # another's, 0.8 s old: served
    clock.t += 0.5
    assert await ahead.body("10.0.0.8", PLAIN) == b"body 2"  # its own last one: rendered again
    clock.t += 0.5
    assert await ahead.body("10.0.0.9", PLAIN) == b"body 2"  # begun after its last request
    assert ahead.served == {"ahead": 2, "in_flight": 0, "on_request": 2}


async def test_a_body_older_than_max_age_is_rendered_again() -> None:
    ahead, clock = _ahead(max_age=2.0)
    await ahead.body("10.0.0.1", PLAIN)
    clock.t += 2.5
    await ahead.body("10.0.0.2", PLAIN)
    assert len(clock.rendered) == 2 and ahead.served["on_request"] == 2


async def test_irregular_fast_and_stopped_scrapers_are_not_rendered_ahead() -> None:
    ahead, clock = _ahead()
    for gap in (15.0, 9.0, 15.0):  # the last two disagree by more than 10%
        clock.t += gap
        await ahead.body("10.0.0.1", PLAIN)
    for _ in range(4):  # a poller faster than MIN_INTERVAL_S
        clock.t += 0.5
        await ahead.body("10.0.0.2", GZIP)
    assert ahead._due(clock.t + 5.0)[0] == []
    last = await _steady(ahead, clock, 10.0, 3, PLAIN)
    assert ahead._due(last + 9.9)[0] == [PLAIN]
    assert ahead._due(last + 31.0) == ([], 1.0)  # silent for three intervals: forgotten
    assert ahead._scrapers == {} and ahead._bodies == {}


async def test_a_steady_scraper_stays_steady_through_a_late_request() -> None:
    ahead, clock = _ahead()
    last = await _steady(ahead, clock, 15.0, 3, PLAIN)
    clock.t = last + 18.0  # 20% late (noted late on a busy loop): still steady
    await ahead.body("10.0.0.9", PLAIN)
    assert ahead._due(clock.t + 15.0 - ahead.lead + 1e-3)[0] == [PLAIN]
    clock.t += 30.0  # a scrape missed: no longer steady until two intervals agree again
    await ahead.body("10.0.0.9", PLAIN)
    assert ahead._due(clock.t + 29.9)[0] == []


async def test_a_request_noted_late_does_not_move_the_schedule() -> None:
    ahead, clock = _ahead()
    first = clock.t
    await _steady(ahead, clock, 15.0, 3, PLAIN)  # at first, +15, +30
    clock.t = first + 47.0  # scheduled at +45, noted 2 s late (a busy loop)
    await ahead.body("10.0.0.9", PLAIN)
    lead = ahead.lead
    assert ahead._due(first + 60.0 - lead - 0.5)[0] == []
    assert ahead._due(first + 60.0 - lead + 1e-3)[0] == [PLAIN]  # for +60, not +62


async def test_each_format_and_phase_gets_its_own_render() -> None:
    ahead, clock = _ahead()
    start = clock.t
    for i in range(3):  # two steady scrapers of one format 7 s apart, and one of gzip
        clock.t = start + 15.0 * i
        await ahead.body("10.0.0.1", PLAIN)
        clock.t = start + 15.0 * i + 7.0
        await ahead.body("10.0.0.2", PLAIN)
        await ahead.body("10.0.0.2", GZIP)
    lead = ahead.lead
    clock.t = start + 45.0 - lead + 1e-3
    assert ahead._due(clock.t)[0] == [PLAIN]
    await ahead._start(PLAIN)
    clock.t = start + 53.0 - lead  # 10.0.0.2's gzip request came 0.3 s after its plain one
    due, _ = ahead._due(clock.t)  # the first scraper's body would be 7 s old: each its own
    assert sorted(due, key=lambda f: f.gzip) == [PLAIN, GZIP]


async def test_requests_during_a_render_share_it() -> None:
    ahead, clock = _ahead()
    gate = asyncio.Event()

    async def slow(fmt: Format) -> bytes:
        await gate.wait()
        return b"shared"

    ahead._render = slow
    first = asyncio.ensure_future(ahead.body("10.0.0.1", PLAIN))
    await asyncio.sleep(0)
    clock.t += 0.01
    second = asyncio.ensure_future(ahead.body("10.0.0.2", PLAIN))
    await asyncio.sleep(0)
    gate.set()
    assert await first == await second == b"shared"
    assert ahead.served == {"ahead": 0, "in_flight": 1, "on_request": 1}
