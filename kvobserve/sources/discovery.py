"""Find an engine's KV-event streams over HTTP: the routes of its profile's `Discovery` (SGLang
`GET /server_info`, vLLM `GET /kv_event_sources`).

Every node asks node 0's URL (vLLM: every API server given). Advertised hosts are kept as the
engine's own: a wildcard or loopback host is `*`, "the node that owns the rank", which each
collector reaches at its own `[collector] host` (sources/plan.py). Parsing per route and engine
version is in discovery_parse.py.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp

from kvobserve.engines import profile
from kvobserve.engines.profile import Discovery
from kvobserve.sources.discovery_parse import (
    PARSERS,
    DiscoveredEngine,
    DiscoveryError,
    block_sizes,
    merge,
    with_block_sizes,
)
from kvobserve.sources.periodic import PeriodicPoll, connect_reason, http_failure_reason

log = logging.getLogger(__name__)


async def _get_text(
    session: aiohttp.ClientSession, url: str, timeout_s: float
) -> tuple[int, str | None]:
    """(status, body text for 200, else None)."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return resp.status, None
            return 200, await resp.text()
    except aiohttp.ClientConnectorError as exc:
        raise DiscoveryError(url, "connection", connect_reason(exc.os_error)) from None
    except (aiohttp.ClientError, TimeoutError, OSError, UnicodeDecodeError) as exc:
        raise DiscoveryError(url, "connection", http_failure_reason(exc, timeout_s)) from None


async def _get_json(session: aiohttp.ClientSession, url: str, timeout_s: float) -> tuple[int, Any]:
    """(status, parsed JSON body or None for non-200)."""
    status, text = await _get_text(session, url, timeout_s)
    if text is None:
        return status, None
    try:
        return 200, json.loads(text)
    except ValueError as exc:
        raise DiscoveryError(url, "body", f"not JSON ({exc})") from None


async def _block_sizes(
    s: aiohttp.ClientSession, base: str, engine: str, timeout_s: float
) -> dict[int, int]:
    """Block size per rank from the server's /metrics; {} when it does not answer."""
    p = profile(engine)
    try:
        _, text = await _get_text(s, base + p.metrics_path, timeout_s)
    except DiscoveryError:
        return {}
    m = p.metrics
    if text is None or m is None or not m.cache_info:
        return {}
    return block_sizes(text, m.cache_info, m.rank_label)


def _discovery(engine: str) -> Discovery:
    d = profile(engine).discovery
    if d is None:
        raise ValueError(f"engine={engine!r}: has no HTTP discovery")
    return d


async def discover(
    url: str, engine: str, *, session: aiohttp.ClientSession | None = None, timeout_s: float = 5.0
) -> DiscoveredEngine:
    """Ask the engine at `url` (its HTTP server) where its KV-event publishers are."""
    base = url.rstrip("/")
    d = _discovery(engine)
    own = session is None
    s = session or aiohttp.ClientSession()
    try:
        for path in d.routes:  # the next route only when this one is not there (404)
            status, body = await _get_json(s, base + path, timeout_s)
            if status == 200:
                found = PARSERS[path](base + path, body)
                if not d.block_sizes:
                    return found
                return with_block_sizes(found, await _block_sizes(s, base, engine, timeout_s))
            if status != 404:
                break
        tried = " and ".join(d.routes[: d.routes.index(path) + 1])
        detail = f"HTTP {status} on {tried}"
        if d.missing and status == 404:
            detail += f": {d.missing}"
        raise DiscoveryError(base, "status", detail)
    finally:
        if own:
            await s.close()


async def discover_urls(
    urls: str | Sequence[str],
    engine: str,
    *,
    session: aiohttp.ClientSession | None = None,
    timeout_s: float = 5.0,
) -> DiscoveredEngine:
    """Discovery from one URL, or several vLLM API servers' lists merged (all must answer)."""
    todo = [urls] if isinstance(urls, str) else list(urls)
    own = session is None
    s = session or aiohttp.ClientSession()
    try:
        found = await asyncio.gather(
            *(discover(u, engine, session=s, timeout_s=timeout_s) for u in todo)
        )
        return merge(list(found))
    finally:
        if own:
            await s.close()


OnChange = Callable[[DiscoveredEngine, DiscoveredEngine | None], Awaitable[None] | None]


class Rediscovery:
    """Re-polls discovery every `interval_s`; calls `on_change(new, old)` when endpoints moved."""

    def __init__(
        self,
        url: str | Sequence[str],
        engine: str,
        *,
        interval_s: float = 30.0,
        timeout_s: float = 5.0,
        on_change: OnChange | None = None,
        current: DiscoveredEngine | None = None,
    ) -> None:
        self.urls = [url] if isinstance(url, str) else list(url)
        self.url, self.engine = self.urls[0], engine
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.on_change = on_change
        self.current = current
        self.last_error: DiscoveryError | None = None
        self.polls_total = self.errors_total = self.changes_total = 0
        self._poll = PeriodicPoll(f"rediscovery {self.url}", interval_s, self.poll_once)

    async def poll_once(self) -> bool:
        """One discovery round; True when the result differs from the previous one."""
        self.polls_total += 1
        try:
            found = await discover_urls(
                self.urls, self.engine, session=self._poll.session(), timeout_s=self.timeout_s
            )
        except DiscoveryError as exc:
            if self.last_error is None or str(exc) != str(self.last_error):
                log.warning("%s", exc)  # once per distinct failure, not every poll
            self.errors_total += 1
            self.last_error = exc
            return False
        self.last_error = None
        old, self.current = self.current, found
        if old == found:
            return False
        self.changes_total += 1
        if self.on_change is not None:
            result = self.on_change(found, old)
            if inspect.isawaitable(result):
                await result
        return True

    async def start(self) -> None:
        """Start polling in the background (first poll at once)."""
        await self._poll.start()

    async def close(self) -> None:
        """Stop polling and close the HTTP session; safe to call twice."""
        await self._poll.close()
