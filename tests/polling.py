"""The suite's one way to wait: poll for a state until a deadline (never sleep to synchronize).

`until(check, timeout_s, what)` calls `check` until it returns something truthy and returns
that; at the deadline it fails with what was awaited, the last value `check` returned (or the
last exception it raised, of the kinds in `retry_on`) and, if given, `describe()` (logs, a
scrape, a snapshot). `until_async` is the same for a test on an event loop: it yields to the
loop between polls, and `check` may be a coroutine function.

Work that is CPU-bound (a replay) takes longer on a busy machine than on a quiet one; such a wait
passes `progress` (a callable whose value changes while the work goes on): then `timeout_s` is
how long it may go without progress, and pytest's timeout bounds the whole.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

# the interval between two polls: short against every deadline here, long enough that a poll
# loop does not take a core from the processes it waits for
INTERVAL_S = 0.02
_SHOWN = 2000  # characters of the last value in a failure message


class _Waiting:
    """One wait's deadline and what it saw, for the failure message."""

    def __init__(
        self,
        timeout_s: float,
        what: str,
        describe: Callable[[], object] | None,
        progress: Callable[[], object] | None,
    ) -> None:
        if not what:
            raise ValueError("until: say what is awaited (what='...')")
        self.timeout_s, self.what, self.describe = timeout_s, what, describe
        self.progress = progress
        self.seen = progress() if progress is not None else None
        self.end = time.monotonic() + timeout_s
        self.last: object = "(not called)"

    def expired(self) -> bool:
        if self.progress is not None and (now := self.progress()) != self.seen:
            self.seen, self.end = now, time.monotonic() + self.timeout_s
        return time.monotonic() > self.end

    def failure(self) -> AssertionError:
        shown = repr(self.last)
        if len(shown) > _SHOWN:
            shown = shown[:_SHOWN] + f"... ({len(shown)} characters)"
        since = " without progress" if self.progress is not None else ""
        text = f"not true after {self.timeout_s} s{since}: {self.what}\nlast value: {shown}"
        if self.describe is not None:
            try:
                text += f"\n{self.describe()}"
            except Exception as exc:  # the message must not hide the timeout
                text += f"\n(describe failed: {exc!r})"
        return AssertionError(text)


def until(
    check: Callable[[], T],
    timeout_s: float,
    what: str,
    describe: Callable[[], object] | None = None,
    *,
    retry_on: tuple[type[Exception], ...] = (),
    interval_s: float = INTERVAL_S,
    progress: Callable[[], object] | None = None,
) -> T:
    """Call `check` until it returns a truthy value; return it, or fail at the deadline saying
    `what`, the last value seen and `describe()`. Exceptions in `retry_on` (a server not up
    yet) count as a falsy value; with `progress`, the deadline moves while its value changes."""
    waiting = _Waiting(timeout_s, what, describe, progress)
    while True:
        try:
            value = check()
        except retry_on as exc:
            waiting.last = exc
        else:
            if value:
                return value
            waiting.last = value
        if waiting.expired():
            raise waiting.failure()
        time.sleep(interval_s)  # polling interval, not synchronization


async def until_async(
    check: Callable[[], T | Awaitable[T]],
    timeout_s: float,
    what: str,
    describe: Callable[[], object] | None = None,
    *,
    retry_on: tuple[type[Exception], ...] = (),
    interval_s: float = INTERVAL_S,
    progress: Callable[[], object] | None = None,
) -> T:
    """`until` on an event loop: the loop runs between polls; `check` may return an awaitable."""
    waiting = _Waiting(timeout_s, what, describe, progress)
    while True:
        try:
            value: Any = check()
            if inspect.isawaitable(value):
                value = await value
        except retry_on as exc:
            waiting.last = exc
        else:
            if value:
                return value
            waiting.last = value
        if waiting.expired():
            raise waiting.failure()
        await asyncio.sleep(interval_s)  # polling interval, not synchronization
