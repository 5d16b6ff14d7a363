"""Find an engine's KV-event streams over HTTP: SGLang `GET /server_info`, vLLM `GET /kv_event_sources`.

Every node asks node 0's URL (vLLM: every API server given). Advertised hosts are kept as the
engine's own: a wildcard or loopback host is `*`, "the node that owns the rank", which each
collector reaches at its own `[collector] host` (sources/plan.py). Parsing per engine version is in
discovery_parse.py.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp

from kvobserve.sources.discovery_parse import (
    DiscoveredEngine,
    DiscoveredSource,
    DiscoveryError,
    merge,
    parse_sglang_server_info,
    parse_vllm_kv_event_sources,
    vllm_block_sizes,
    with_block_sizes,
)
from kvobserve.sources.periodic import PeriodicPoll, connect_reason, http_failure_reason

__all__ = [
    "DiscoveredEngine",
    "DiscoveredSource",
    "DiscoveryError",
    "Rediscovery",
    "discover",
    "discover_urls",
    "parse_sglang_server_info",
    "parse_vllm_kv_event_sources",
]
NO_ROUTE_VLLM = (
    "vLLM before 0.31 has no /kv_event_sources; give kv_endpoint, replay_endpoint and dp_size "
    "in the [[worker]] table by hand"
)

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


async def _vllm_block_sizes(
    s: aiohttp.ClientSession, base: str, timeout_s: float
) -> dict[int, int]:
    """Block size per engine from the API server's /metrics; {} when it does not answer."""
    try:
        _, text = await _get_text(s, base + "/metrics", timeout_s)
    except DiscoveryError:
        return {}
    return vllm_block_sizes(text) if text is not None else {}


async def discover(
    url: str, engine: str, *, session: aiohttp.ClientSession | None = None, timeout_s: float = 5.0
) -> DiscoveredEngine:
    """Ask the engine at `url` (its HTTP server) where its KV-event publishers are."""
    base = url.rstrip("/")
    paths = ["/server_info", "/get_server_info"] if engine == "sglang" else ["/kv_event_sources"]
    own = session is None
    s = session or aiohttp.ClientSession()
    try:
        for path in paths:  # /get_server_info: the name before SGLang deprecated it
            status, body = await _get_json(s, base + path, timeout_s)
            if status == 200:
                if engine == "sglang":
                    return parse_sglang_server_info(base + path, body)
                found = parse_vllm_kv_event_sources(base + path, body)
                return with_block_sizes(found, await _vllm_block_sizes(s, base, timeout_s))
            if status != 404:
                break
        tried = " and ".join(paths[: paths.index(path) + 1])
        detail = f"HTTP {status} on {tried}"
        if engine == "vllm" and status == 404:
            detail += f": {NO_ROUTE_VLLM}"
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
