"""The simulated engine's HTTP side: `/metrics` with the engines' names and discovery endpoints.

Runs aiohttp on its own event loop in its own thread so a worker embeds in any program (sync or
asyncio). Values are read from the worker at scrape time; nothing is updated per batch. Routes
follow the node's role: SGLang node 0 serves the API, nodes >= 1 the engine's dummy server;
a vLLM API server serves the ranks it manages (every rank on node 0 with internal LB).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvobserve.simulate.discovery import ANSWERS
from kvobserve.simulate.engines.base import NodeMetrics, RankLoad
from kvobserve.simulate.serve import ThreadedApp

if TYPE_CHECKING:
    from kvobserve.simulate.ranks import Node, RankState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
HEALTH_ROUTES = frozenset({"/health", "/health_generate", "/ping"})  # "ok" while it runs


class _EngineMetrics(Collector):
    """The engine's own scheduler metrics (its simulator profile's `metrics`), read at scrape
    time from the ranks this node's server reports."""

    def __init__(self, w: Node) -> None:
        self.w = w

    def collect(self) -> Iterator[Metric]:
        w, c = self.w, self.w.cfg
        make = c.engine.metrics
        if make is None:
            return iter(())
        loads = [
            RankLoad(
                st.rank, s.running, s.waiting, s.held_tokens, s.hit_rate, s.query_tokens,
                s.hit_tokens, s.batch_hit_rate,
            )
            for st in self._ranks()
            for s in st.streams[:1]
        ]  # fmt: skip
        totals = None
        if c.http_role == "api":  # every request of the worker passes node 0's tokenizer
            streams = [st.streams[0] for n in (w, *w.peers) for st in n.ranks]
            totals = (sum(s.query_tokens for s in streams), sum(s.hit_tokens for s in streams))
        node = NodeMetrics(w.fmt, c.model_name, c.capacity_tokens, c.page_size, loads, totals)
        return iter(make(node))

    def _ranks(self) -> list[RankState]:
        """This node's ranks; an API server that reports every rank it manages (vLLM) with
        internal LB also the other nodes' (in-process), as the real one hears every engine."""
        w = self.w
        if not w.cfg.engine.reports_managed_ranks:
            return list(w.ranks)
        managed = set(w.cfg.managed_ranks())
        ranks = (st for n in (w, *w.peers) for st in n.ranks if st.rank in managed)
        return sorted(ranks, key=lambda st: st.rank)


class SimHttpServer:
    """aiohttp on a private loop in a thread; `start()` returns the bound port."""

    def __init__(self, w: Node, host: str, port: int) -> None:
        self.w = w
        self.host = host
        self.port = port
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_EngineMetrics(w))
        self._server = ThreadedApp(host, port, "sim-http", "http_port")

    def _app(self) -> web.Application:
        """The routes this version serves in this node's role (its format's routes)."""
        w = self.w
        routes = w.fmt.stub_routes if w.cfg.http_role == "stub" else w.fmt.api_routes
        app = web.Application()
        for path in routes:
            if path in HEALTH_ROUTES:
                app.router.add_get(path, self._health)
            elif path == "/metrics":
                app.router.add_get(path, self._metrics)
            else:
                app.router.add_get(path, self._answer(ANSWERS[path]))
        return app

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    def _answer(
        self, build: Callable[[Node], dict[str, Any]]
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            return web.json_response(build(self.w))

        return handle

    def start(self) -> int:
        """Serve in a background thread; the bound port (OSError if it cannot bind)."""
        self.port = self._server.start(self._app)
        return self.port

    def stop(self) -> None:
        """Stop serving; idempotent."""
        self._server.stop()
