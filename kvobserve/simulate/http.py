"""The simulated engine's HTTP side: `/metrics` with the engines' names and discovery endpoints.

Runs aiohttp on its own event loop in its own thread so a worker embeds in any program (sync or
asyncio). Values are read from the worker at scrape time; nothing is updated per batch. Routes
follow the node's role: SGLang node 0 serves the API, nodes >= 1 the engine's dummy server;
a vLLM API server serves the ranks it manages (every rank on node 0 with internal LB).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvobserve.simulate.discovery import kv_event_sources, server_info
from kvobserve.simulate.serve import ThreadedApp

if TYPE_CHECKING:
    from kvobserve.simulate.ranks import RankState
    from kvobserve.simulate.worker import SimulatedWorker

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineMetrics(Collector):
    """SGLang `sglang:*` or vLLM `vllm:*` scheduler metrics, one series per hosted rank."""

    def __init__(self, w: SimulatedWorker) -> None:
        self.w = w

    def collect(self) -> Iterator[Metric]:
        w = self.w
        return self._sglang() if w.fmt.engine == "sglang" else self._vllm()

    def _sglang(self) -> Iterator[Metric]:
        w, c = self.w, self.w.cfg
        names = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank", "dp_rank"]
        fams = {
            "num_running_reqs": "The number of running requests.",
            "num_queue_reqs": "The number of requests in the waiting queue.",
            "token_usage": "The token usage.",
            "num_used_tokens": "The number of used tokens.",
            "cache_hit_rate": "The prefix cache hit rate.",
            "max_total_num_tokens": "Maximum total number of tokens in the KV cache pool.",
            "page_size": "The page size of the KV cache.",
        }
        out = {k: GaugeMetricFamily(f"sglang:{k}", doc, labels=names) for k, doc in fams.items()}
        for st in w.ranks:
            s = st.streams[0]
            labels = [c.model_name, "unified", "0", "0", "0", str(st.rank)]
            used = s.held_tokens  # SGLang: total - available - evictable
            out["num_running_reqs"].add_metric(labels, s.running)
            out["num_queue_reqs"].add_metric(labels, s.waiting)
            out["token_usage"].add_metric(labels, used / c.capacity_tokens)
            out["num_used_tokens"].add_metric(labels, used)
            out["cache_hit_rate"].add_metric(labels, s.batch_hit_rate)  # the last prefill batch
            out["max_total_num_tokens"].add_metric(labels, c.capacity_tokens)
            out["page_size"].add_metric(labels, c.page_size)
        yield from out.values()
        if c.http_role != "api":
            return
        # the tokenizer's counters: every request of the worker passes node 0's tokenizer
        prompt = CounterMetricFamily(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", labels=["model_name"]
        )
        cached = CounterMetricFamily(
            "sglang:cached_tokens", "Number of cached prompt tokens.", labels=["model_name"]
        )
        streams = [st.streams[0] for n in (w, *w.peers) for st in n.ranks]
        prompt.add_metric([c.model_name], sum(s.query_tokens for s in streams))
        cached.add_metric([c.model_name], sum(s.hit_tokens for s in streams))
        yield from (prompt, cached)

    def _vllm(self) -> Iterator[Metric]:
        w, c = self.w, self.w.cfg
        old = w.fmt.version < (11, 0)  # 0.10 still used the gpu_* names
        usage = "vllm:gpu_cache_usage_perc" if old else "vllm:kv_cache_usage_perc"
        prefix = "vllm:gpu_prefix_cache_" if old else "vllm:prefix_cache_"
        names = ["model_name", "engine"]
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Requests in model execution batches.", labels=names
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Requests waiting to be processed.", labels=names
        )
        kv = GaugeMetricFamily(usage, "KV-cache usage. 1 means 100 percent usage.", labels=names)
        queries = CounterMetricFamily(
            f"{prefix}queries", "Prefix cache queries, in tokens.", labels=names
        )
        hits = CounterMetricFamily(f"{prefix}hits", "Prefix cache hits, in tokens.", labels=names)
        info_labels = ["block_size", "num_gpu_blocks", "enable_prefix_caching", "engine"]
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=info_labels
        )
        for st in self._vllm_ranks():
            s = st.streams[0]
            labels = [c.model_name, str(st.rank)]
            running.add_metric(labels, s.running)
            waiting.add_metric(labels, s.waiting)
            kv.add_metric(labels, s.held_tokens / c.capacity_tokens)  # blocks with ref_cnt > 0
            queries.add_metric(labels, s.query_tokens)
            hits.add_metric(labels, s.hit_tokens)
            blocks = str(c.capacity_tokens // c.page_size)
            info.add_metric([str(c.page_size), blocks, "True", str(st.rank)], 1.0)
        yield from (running, waiting, kv, queries, hits, info)

    def _vllm_ranks(self) -> list[RankState]:
        """The ranks this API server manages: with internal LB, the other nodes' too (in-process)."""
        w = self.w
        if w.cfg.dp_lb == "hybrid":
            return list(w.ranks)
        return sorted((st for n in (w, *w.peers) for st in n.ranks), key=lambda st: st.rank)


class SimHttpServer:
    """aiohttp on a private loop in a thread; `start()` returns the bound port."""

    def __init__(self, w: SimulatedWorker, host: str, port: int) -> None:
        self.w = w
        self.host = host
        self.port = port
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_EngineMetrics(w))
        self._server = ThreadedApp(host, port, "sim-http", "http_port")

    def _app(self) -> web.Application:
        w = self.w
        old = w.fmt.engine == "sglang" and w.fmt.version < (5, 0)  # SGLang 0.4.7
        app = web.Application()
        app.router.add_get("/health", self._health)
        if w.fmt.engine == "sglang":
            app.router.add_get("/health_generate", self._health)
        if w.cfg.http_role == "stub":  # SGLang nodes >= 1: /metrics of this node's schedulers
            if not old:  # (sglang #7720, mid 2025) and /ping
                app.router.add_get("/metrics", self._metrics)
                app.router.add_get("/ping", self._health)
            return app
        app.router.add_get("/metrics", self._metrics)
        if w.fmt.engine == "sglang":
            if not old:  # 0.4.7 had only the name that 0.5 deprecated
                app.router.add_get("/server_info", self._server_info)
            app.router.add_get("/get_server_info", self._server_info)
        elif w.fmt.version >= (31, 0):
            app.router.add_get("/kv_event_sources", self._sources)
        return app

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response(server_info(self.w))

    async def _sources(self, request: web.Request) -> web.Response:
        return web.json_response(kv_event_sources(self.w))

    def start(self) -> int:
        """Serve in a background thread; the bound port (OSError if it cannot bind)."""
        self.port = self._server.start(self._app)
        return self.port

    def stop(self) -> None:
        """Stop serving; idempotent."""
        self._server.stop()
