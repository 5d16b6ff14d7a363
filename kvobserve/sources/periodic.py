"""A background task that polls an HTTP endpoint every interval, with one reused session; why a
poll failed, in one line."""

from __future__ import annotations

import asyncio
import os
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


def http_status_reason(status: int, text: str | None) -> str:
    """`HTTP 404 Not Found (...)`: the status line, with a hint where there is one."""
    hint = " (SGLang serves /metrics only with --enable-metrics)" if status == 404 else ""
    return f"HTTP {status} {text or ''}".rstrip() + hint


def http_failure_reason(exc: BaseException, timeout_s: float) -> str:
    """One line for a failed scrape: refused, no answer, not text."""
    if isinstance(exc, TimeoutError):
        return f"no answer in {timeout_s:g} s"
    if isinstance(exc, UnicodeDecodeError):
        return "the answer is not text"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect: {connect_reason(exc.os_error)}"
    return f"request failed: {exc.__class__.__name__}: {exc}".rstrip(": ")


def connect_reason(err: OSError) -> str:
    """Why a connect failed, in lower case: `connection refused`, `name or service not known`."""
    # aiohttp's ConnectionRefusedError has the strerror "Connect call failed (host, port)"
    text = os.strerror(err.errno) if err.errno and err.errno > 0 else err.strerror or str(err)
    return text[:1].lower() + text[1:]
