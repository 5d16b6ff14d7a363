"""Find an engine's KV-event streams over HTTP: SGLang `GET /server_info`, vLLM `GET /kv_event_sources`.

Engines advertise wildcard (`*`, `0.0.0.0`, `::`) or loopback hosts; a collector on another node
must connect to the host it reached the engine at, so those are replaced by the URL's host.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from kvobserve.config import WILDCARD_HOSTS, split_host_port
from kvobserve.sources.periodic import PeriodicPoll

log = logging.getLogger(__name__)


class DiscoveryError(Exception):
    """Discovery failed; names the URL and the field (or `connection`, `status`, `body`)."""

    def __init__(self, url: str, field: str, detail: str) -> None:
        super().__init__(f"discovery {url}: {field}: {detail}")
        self.url, self.field, self.detail = url, field, detail


@dataclass(frozen=True, slots=True)
class DiscoveredSource:
    """One DP rank's KV-event publisher."""

    dp_rank: int
    endpoint: str
    replay_endpoint: str | None
    topic: str
    block_size: int | None


@dataclass(frozen=True, slots=True)
class DiscoveredEngine:
    """What an engine advertises; equal objects mean nothing moved."""

    engine: str
    url: str
    dp_size: int
    sources: tuple[DiscoveredSource, ...]
    block_size: int | None = None
    load_endpoint_base: str | None = None  # SGLang load PUB of rank 0; rank r = port + r
    load_topic: str | None = None
    version: str | None = None


def _is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost."""
    return host.startswith("127.") or host in ("::1", "localhost")


def _bracket(host: str) -> str:
    """IPv6 literals are bracketed in endpoints."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _public_endpoint(endpoint: str, url_host: str) -> str:
    """Replace a wildcard (or, seen from another host, loopback) tcp host with the URL's host."""
    scheme, sep, rest = endpoint.partition("://")
    if scheme != "tcp" or not sep:
        return endpoint  # ipc/inproc: only usable on the engine's own node, kept as advertised
    try:
        host, port = split_host_port(rest)
    except ValueError:
        return endpoint  # malformed: kept as advertised, the connect attempt reports it
    if host in WILDCARD_HOSTS or (_is_loopback(host) and not _is_loopback(url_host)):
        return f"tcp://{_bracket(url_host)}:{port}"
    return endpoint


def _get(
    obj: dict[str, Any], key: str, typ: type, url: str, where: str, required: bool = True
) -> Any:
    """obj[key] of type `typ`, or a DiscoveryError naming `where.key`."""
    value = obj.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise DiscoveryError(url, f"{where}{key}", f"expected {typ.__name__}, got {value!r}")
    return value


def parse_sglang_server_info(url: str, body: Any) -> DiscoveredEngine:
    """SGLang `/server_info`: per-rank `kv_event_sources` where listed, else the `kv_events` bases."""
    if not isinstance(body, dict):
        raise DiscoveryError(url, "body", f"expected a JSON object, got {type(body).__name__}")
    host = urlsplit(url).hostname or "127.0.0.1"
    kv, listed = body.get("kv_events"), body.get("kv_event_sources") or []
    if kv is None and not listed:
        raise DiscoveryError(url, "kv_events", "null: the engine runs without --kv-events-config")
    if not isinstance(listed, list):
        raise DiscoveryError(url, "kv_event_sources", f"expected a list, got {listed!r}")
    by_rank: dict[int, DiscoveredSource] = {}
    for i, item in enumerate(listed):
        where = f"kv_event_sources[{i}]."
        if not isinstance(item, dict):
            raise DiscoveryError(url, where[:-1], f"expected an object, got {item!r}")
        rank = _get(item, "dp_rank", int, url, where)
        replay = _get(item, "replay_endpoint", str, url, where, required=False)
        by_rank[rank] = DiscoveredSource(
            rank,
            _public_endpoint(_get(item, "endpoint", str, url, where), host),
            _public_endpoint(replay, host) if replay else None,
            _get(item, "topic", str, url, where, required=False) or "",
            _get(item, "block_size", int, url, where, required=False),
        )
    dp_size, block_size, load_base, load_topic = max(by_rank, default=-1) + 1, None, None, None
    if kv is not None:
        if not isinstance(kv, dict):
            raise DiscoveryError(url, "kv_events", f"expected an object, got {kv!r}")
        w = "kv_events."
        dp_size = max(dp_size, _get(kv, "dp_size", int, url, w))
        base = _get(kv, "endpoint_port_base", int, url, w)
        replay_base = _get(kv, "replay_endpoint_port_base", int, url, w, required=False)
        ehost = _get(kv, "endpoint_host", str, url, w)
        ehost = _bracket(host if ehost in WILDCARD_HOSTS or ehost == "[::]" else ehost)
        topic = _get(kv, "topic", str, url, w, required=False) or ""
        block_size = _get(kv, "block_size", int, url, w, required=False)
        for r in range(dp_size):
            if r not in by_rank:
                replay = f"tcp://{ehost}:{replay_base + r}" if replay_base is not None else None
                by_rank[r] = DiscoveredSource(
                    r, f"tcp://{ehost}:{base + r}", replay, topic, block_size
                )
        load_port = _get(kv, "load_endpoint_port_base", int, url, w, required=False)
        if load_port is not None:
            load_base = f"tcp://{ehost}:{load_port}"
            load_topic = _get(kv, "load_topic", str, url, w, required=False) or "load"
    if dp_size < 1:
        raise DiscoveryError(url, "kv_events.dp_size", f"must be >= 1, got {dp_size}")
    sources = tuple(by_rank[r] for r in sorted(by_rank))
    version = body.get("version") if isinstance(body.get("version"), str) else None
    return DiscoveredEngine(
        "sglang", url, dp_size, sources, block_size, load_base, load_topic, version
    )


def parse_vllm_kv_event_sources(url: str, body: Any) -> DiscoveredEngine:
    """vLLM `/kv_event_sources`: `{dp_rank: KVEventsConfig}` with resolved endpoints."""
    if not isinstance(body, dict) or not body:
        raise DiscoveryError(
            url, "body", f"expected a non-empty object {{dp_rank: config}}, got {body!r}"
        )
    host = urlsplit(url).hostname or "127.0.0.1"
    sources: list[DiscoveredSource] = []
    for key, cfg in body.items():
        if not str(key).isdigit():
            raise DiscoveryError(url, f"[{key!r}]", "key is not a DP rank")
        where = f"[{key}]."
        if not isinstance(cfg, dict):
            raise DiscoveryError(url, where[:-1], f"expected an object, got {cfg!r}")
        if cfg.get("enable_kv_cache_events") is False or cfg.get("publisher") == "null":
            continue
        replay = _get(cfg, "replay_endpoint", str, url, where, required=False)
        sources.append(
            DiscoveredSource(
                int(key),
                _public_endpoint(_get(cfg, "endpoint", str, url, where), host),
                _public_endpoint(replay, host) if replay else None,
                _get(cfg, "topic", str, url, where, required=False) or "",
                None,
            )
        )
    if not sources:
        raise DiscoveryError(url, "enable_kv_cache_events", "no DP rank publishes KV events")
    sources.sort(key=lambda s: s.dp_rank)
    return DiscoveredEngine("vllm", url, sources[-1].dp_rank + 1, tuple(sources))


async def _get_json(session: aiohttp.ClientSession, url: str, timeout_s: float) -> tuple[int, Any]:
    """(status, parsed JSON body or None for non-200)."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return resp.status, None
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise DiscoveryError(url, "connection", str(exc) or type(exc).__name__) from None
    try:
        return 200, json.loads(text)
    except ValueError as exc:
        raise DiscoveryError(url, "body", f"not JSON ({exc})") from None


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
                return parse_vllm_kv_event_sources(base + path, body)
            if status != 404:
                break
        tried = " and ".join(paths[: paths.index(path) + 1])
        raise DiscoveryError(base, "status", f"HTTP {status} on {tried}")
    finally:
        if own:
            await s.close()


OnChange = Callable[[DiscoveredEngine, DiscoveredEngine | None], Awaitable[None] | None]


class Rediscovery:
    """Re-polls discovery every `interval_s`; calls `on_change(new, old)` when endpoints moved."""

    def __init__(
        self,
        url: str,
        engine: str,
        *,
        interval_s: float = 30.0,
        timeout_s: float = 5.0,
        on_change: OnChange | None = None,
        current: DiscoveredEngine | None = None,
    ) -> None:
        self.url, self.engine = url, engine
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.on_change = on_change
        self.current = current
        self.last_error: DiscoveryError | None = None
        self.polls_total = self.errors_total = self.changes_total = 0
        self._poll = PeriodicPoll(f"rediscovery {url}", interval_s, self.poll_once)

    async def poll_once(self) -> bool:
        """One discovery round; True when the result differs from the previous one."""
        self.polls_total += 1
        try:
            found = await discover(
                self.url, self.engine, session=self._poll.session(), timeout_s=self.timeout_s
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
