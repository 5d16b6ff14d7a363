"""The HTTP side: /metrics, /healthz, /readyz, /api/v1/*, the status page; basic auth and TLS."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import json
import ssl
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder
from prometheus_client.metrics_core import Metric

from kvobserve.analysis.conditions import DEFAULT_RUNBOOK_URL
from kvobserve.analysis.overlap import OverlapAnswer, PoolError
from kvobserve.config import split_host_port
from kvobserve.export import api, status_page
from kvobserve.export.ahead import Format, RenderAhead
from kvobserve.export.prometheus import ExtraProvider, FleetCollector, ViewProvider
from kvobserve.export.scrape import GZIP_LEVEL, ScrapeCache
from kvobserve.wire.kv_events import BlockHash
from kvobserve.wire.overlap import MAX_HASHES

MAX_REQUEST_BYTES = 4096
# the request line: /api/v1/overlap carries up to MAX_HASHES hashes of 64 hex digits, each
# with a comma that a client may send as %2C
MAX_LINE_BYTES = MAX_HASHES * 68 + 4096
REGISTRY = web.AppKey("registry", CollectorRegistry)
FLEET = web.AppKey("fleet", FleetCollector)
CACHE = web.AppKey("scrape_cache", object)  # ScrapeCache, or None: render every scrape afresh
AHEAD = web.AppKey("render_ahead", RenderAhead)
VIEW = web.AppKey("view", object)  # ViewProvider; AppKey wants a runtime type
READY = web.AppKey("ready", object)
AUTH = web.AppKey("auth", object)
REFRESH = web.AppKey("refresh_s", float)
EVENTS = web.AppKey("events", object)  # () -> recent events (dicts), or None
RUNBOOK = web.AppKey("runbook_url", str)
OVERLAP = web.AppKey("overlap", object)  # OverlapAsk, or None: not served here
_OPEN_PATHS = frozenset({"/healthz", "/readyz"})  # probes carry no credentials
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# (hashes, pool, timeout_s) -> the collectors' answers (Aggregator.overlap)
OverlapAsk = Callable[[list[BlockHash], str | None, float], Awaitable[OverlapAnswer]]


def _view(request: web.Request) -> Any:
    provider: ViewProvider = request.app[VIEW]  # type: ignore[assignment]
    return provider()


def _json(data: object) -> web.Response:
    return web.Response(
        text=json.dumps(data, separators=(",", ":"), sort_keys=True),
        content_type="application/json",
    )


class _Collected:
    """Families already collected on the loop, for an encoder running in a thread."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> list[Metric]:
        """The families, as a registry would yield them."""
        return self._metrics


def _fast_format(content_type: str) -> bool | None:
    """False: text 0.0.4, True: OpenMetrics, None: a variant only prometheus_client writes."""
    if content_type == CONTENT_TYPE_PLAIN_0_0_4:
        return False
    if content_type.startswith("application/openmetrics-text") and (
        "escaping" not in content_type
        or content_type.endswith(("escaping=underscores", "escaping=allow-utf-8"))
    ):
        return True  # our names are legacy-valid: these escapings leave them as they are
    return None


def accepts_gzip(header: str) -> bool:
    """Whether an Accept-Encoding header allows gzip (q=0 refuses it; `*` allows it)."""
    allowed: dict[str, bool] = {}
    for item in header.split(","):
        name, _, params = item.strip().partition(";")
        q = 1.0
        for p in params.split(";"):
            key, _, val = p.strip().partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(val)
                except ValueError:
                    q = 0.0
        allowed[name.strip().lower()] = q > 0
    return allowed.get("gzip", allowed.get("x-gzip", allowed.get("*", False)))


async def _metrics(request: web.Request) -> web.Response:
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    gzip = accepts_gzip(request.headers.get("Accept-Encoding", ""))
    # The view and the extras are taken on the loop (the fleet state is only touched there);
    # rendering works on that immutable view, so it runs off the loop. The catalog families
    # come from per-collector text kept until the collector's next snapshot (export/scrape.py,
    # same bytes, docs/performance.md), rendered ahead for steady scrapers (export/ahead.py);
    # other format variants, and every scrape without the cache, are prometheus_client's.
    openmetrics = _fast_format(content_type)
    cache: ScrapeCache | None = request.app[CACHE]  # type: ignore[assignment]
    if openmetrics is not None and cache is not None:
        fmt = Format(content_type, gzip, openmetrics, encoder)
        body = await request.app[AHEAD].body(request.remote or "", fmt)
    else:
        render = partial(encoder, _Collected(list(request.app[REGISTRY].collect())))
        if gzip:
            render = partial(_gzipped, render)
        body = await asyncio.to_thread(render)
    headers = {"Content-Type": content_type, "Vary": "Accept-Encoding"}
    if gzip:
        headers["Content-Encoding"] = "gzip"
    return web.Response(body=body, headers=headers)


async def _render_cached(app: web.Application, fmt: Format) -> bytes:
    """A body from the scrape cache (on request or ahead)."""
    fleet: FleetCollector = app[FLEET]
    cache: ScrapeCache = app[CACHE]  # type: ignore[assignment]
    view, extra = fleet.take()
    return await asyncio.to_thread(
        cache.render, view, extra, fmt.encoder, fmt.openmetrics, fmt.gzip
    )


async def _render_ahead(app: web.Application) -> AsyncIterator[None]:
    """Run the render-ahead loop while the app runs (cleanup_ctx)."""
    task = asyncio.create_task(app[AHEAD].run())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _gzipped(render: Callable[[], bytes]) -> bytes:
    return zlib.compress(render(), GZIP_LEVEL, wbits=31)


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def _readyz(request: web.Request) -> web.Response:
    ready: Callable[[], bool] | None = request.app[READY]  # type: ignore[assignment]
    ok = ready() if ready is not None else bool(_view(request).collectors)
    if ok:
        return web.Response(text="ready\n")
    return web.Response(status=503, text="not ready: no collector snapshot yet\n")


async def _streams(request: web.Request) -> web.Response:
    return _json(api.streams_json(_view(request)))


async def _alerts(request: web.Request) -> web.Response:
    return _json(api.alerts_json(_view(request), request.app[RUNBOOK]))


def _recent(request: web.Request, limit: int = 100) -> list[dict[str, Any]]:
    provider: Callable[[], list[dict[str, Any]]] | None = request.app[EVENTS]  # type: ignore[assignment]
    return api.events_json(provider() if provider is not None else [], limit)


async def _events(request: web.Request) -> web.Response:
    """GET /api/v1/events[?limit=N]: newest first, N at most 1000 (default 100)."""
    try:
        limit = min(1000, max(1, int(request.query.get("limit", "100"))))
    except ValueError:
        return web.Response(status=400, text="limit: expected a number\n")
    return _json(_recent(request, limit))


async def _fleet(request: web.Request) -> web.Response:
    return _json(api.fleet_json(_view(request)))


async def _hot(request: web.Request) -> web.Response:
    return _json(api.hot_json(_view(request)))


async def _misses(request: web.Request) -> web.Response:
    return _json(api.misses_json(_view(request)))


async def _capacity(request: web.Request) -> web.Response:
    """GET /api/v1/capacity[?pool=P][&tier_tokens=N] (docs/cache-analytics.md)."""
    try:
        pool, tier = api.capacity_query(request.query)
    except api.QueryError as exc:
        return web.Response(status=400, text=f"{exc}\n")
    return _json(api.capacity_json(_view(request), pool, tier))


async def _overlap(request: web.Request) -> web.Response:
    """GET /api/v1/overlap?hashes=h1,h2,...[&pool=P][&timeout_s=S] (docs/cache-analytics.md)."""
    ask: OverlapAsk | None = request.app[OVERLAP]  # type: ignore[assignment]
    if ask is None:
        return web.Response(status=404, text="overlap: not served here\n")
    try:
        hashes, pool, timeout_s = api.overlap_query(
            request.query, request.query.getall("hashes", [])
        )
        answer = await ask(hashes, pool, timeout_s)
    except (api.QueryError, PoolError) as exc:
        return web.Response(status=400, text=f"{exc}\n")
    except RuntimeError as exc:  # no transport yet (an aggregator still starting)
        return web.Response(status=503, text=f"overlap: {exc}\n")
    return _json(api.overlap_json(answer))


async def _index(request: web.Request) -> web.Response:
    v = _view(request)
    page = status_page.render(
        api.fleet_json(v),
        api.streams_json(v),
        api.alerts_json(v, request.app[RUNBOOK]),
        generated=time.time(),
        refresh_s=request.app[REFRESH],
        events=_recent(request),
        hot=api.hot_json(v, status_page.HOT_SHOWN),
        misses=api.misses_json(v),
        capacity=api.capacity_json(v),
    )
    return web.Response(text=page, content_type="text/html", charset="utf-8")


@web.middleware
async def _limits(request: web.Request, handler: Handler) -> web.StreamResponse:
    # Every route is a GET: refuse any body instead of buffering it.
    if request.body_exists or request.content_length:
        return web.Response(status=413, text="request bodies are not accepted\n")
    resp = await handler(request)
    resp.headers.setdefault("Cache-Control", "no-store")
    resp.headers.setdefault("X-Content-Type-Options", "nosniff")
    return resp


def _auth_middleware(user: str, password: str) -> Callable[..., Awaitable[web.StreamResponse]]:
    expected = f"{user}:{password}".encode()

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in _OPEN_PATHS:
            return await handler(request)
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        given = b""
        if scheme.lower() == "basic":
            try:
                given = base64.b64decode(token.strip(), validate=True)
            except (binascii.Error, ValueError):
                given = b""
        if not hmac.compare_digest(given, expected):
            return web.Response(
                status=401,
                text="unauthorized\n",
                headers={"WWW-Authenticate": 'Basic realm="kvobserve", charset="UTF-8"'},
            )
        return await handler(request)

    return auth


def create_app(
    view_provider: ViewProvider,
    *,
    extra_metrics: ExtraProvider | None = None,
    basic_auth: tuple[str, str] | None = None,
    ready: Callable[[], bool] | None = None,
    refresh_s: float = 5.0,
    per_stream_detail: bool = False,
    scrape_cache: bool = True,
    render_ahead_s: float = 2.0,
    events: Callable[[], list[dict[str, Any]]] | None = None,
    runbook_url: str = DEFAULT_RUNBOOK_URL,
    shard: str = "",
    overlap: OverlapAsk | None = None,
) -> web.Application:
    """The aiohttp application; `ready` defaults to "at least one collector snapshot".

    `per_stream_detail` serves block lifetimes and block/event counters per stream instead of
    per worker, and the cache-analytics detail families (docs/metrics.md, series budget);
    `scrape_cache=False` renders every scrape afresh with prometheus_client's encoders;
    `render_ahead_s`: bodies for steady scrapers are rendered just before their requests and at
    most this old when served (export/ahead.py; 0: on request only);
    `events` gives the recent events of /api/v1/events; `runbook_url` is docs/alerts.md's URL.
    `shard` (one of several sharded aggregators) labels the per-collector series; `overlap`
    answers /api/v1/overlap (None: 404).
    """
    middlewares: list[Any] = [_limits]
    if basic_auth is not None:
        middlewares.append(_auth_middleware(*basic_auth))
    app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=middlewares)
    registry = CollectorRegistry(auto_describe=False)
    fleet = FleetCollector(
        view_provider,
        extra_metrics,
        per_stream_detail=per_stream_detail,
        shard=shard,
    )
    registry.register(fleet)
    app[REGISTRY] = registry
    app[FLEET] = fleet
    app[CACHE] = ScrapeCache(fleet.detail) if scrape_cache else None
    app[AHEAD] = RenderAhead(partial(_render_cached, app), render_ahead_s)
    if scrape_cache and render_ahead_s > 0:
        app.cleanup_ctx.append(_render_ahead)
    app[VIEW] = view_provider
    app[READY] = ready
    app[REFRESH] = float(refresh_s)
    app[EVENTS] = events
    app[RUNBOOK] = runbook_url.rstrip("#")
    app[OVERLAP] = overlap
    app.router.add_get("/", _index)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/api/v1/streams", _streams)
    app.router.add_get("/api/v1/alerts", _alerts)
    app.router.add_get("/api/v1/fleet", _fleet)
    app.router.add_get("/api/v1/events", _events)
    app.router.add_get("/api/v1/hot", _hot)
    app.router.add_get("/api/v1/misses", _misses)
    app.router.add_get("/api/v1/capacity", _capacity)
    app.router.add_get("/api/v1/overlap", _overlap)
    return app


def parse_listen(listen: str) -> tuple[str, int]:
    """'host:port', '[v6]:port' or ':port' (all interfaces) -> (host, port); ValueError names it."""
    try:
        host, port = split_host_port(listen)
    except ValueError:
        raise ValueError(f"listen: {listen!r} is not host:port (e.g. 127.0.0.1:9477)") from None
    return host or "0.0.0.0", port


def make_ssl_context(cert: str, key: str) -> ssl.SSLContext:
    """A TLS 1.2+ server context from PEM files; ValueError names the file that failed."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except FileNotFoundError as exc:
        raise ValueError(f"tls: cannot read {exc.filename or cert}: no such file") from None
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"tls: cert {cert!r} / key {key!r} unusable: {exc}") from None
    return ctx


@dataclass
class HttpServer:
    """A started server: where it listens and how to stop it."""

    runner: web.AppRunner
    host: str
    port: int
    tls: bool

    @property
    def url(self) -> str:
        """Base URL (no trailing slash)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    async def close(self) -> None:
        """Stop listening and finish open requests (idempotent)."""
        await self.runner.cleanup()


async def serve(
    app: web.Application, listen: str, ssl_context: ssl.SSLContext | None = None
) -> HttpServer:
    """Start `app` on `listen` ('host:port'; port 0 picks a free one)."""
    host, port = parse_listen(listen)
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        shutdown_timeout=1.0,
        max_line_size=MAX_LINE_BYTES,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(exc.errno, f"listen {listen}: {exc.strerror or exc}") from None
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1] if runner.addresses else port
    return HttpServer(runner, host, int(bound), ssl_context is not None)
