"""A background task that polls an HTTP endpoint every interval, with one reused session."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp

from kvobserve.aio import cancel_and_wait


class PeriodicPoll:
    """Runs `poll()` now and then every `interval_s` until closed; start/close are idempotent."""

    def __init__(self, name: str, interval_s: float, poll: Callable[[], Awaitable[object]]) -> None:
        self.name, self.interval_s, self._poll = name, interval_s, poll
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    def session(self) -> aiohttp.ClientSession:
        """The HTTP session every poll shares (created on first use, inside the loop)."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _run(self) -> None:
        while True:
            await self._poll()
            await asyncio.sleep(self.interval_s)

    async def start(self) -> None:
        """Start polling in the background (the first poll at once)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self.name)

    async def close(self) -> None:
        """Stop polling and close the session; safe to call twice."""
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
        session, self._session = self._session, None
        if session is not None:
            await session.close()
