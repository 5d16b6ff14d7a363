"""The simulated engine's HTTP side: `/metrics` with the engines' names and discovery endpoints.

Runs aiohttp on its own event loop in its own thread so a worker embeds in any program (sync or
asyncio). Values are read from the worker at scrape time; nothing is updated per batch.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvobserve.simulate.worker import SimulatedWorker

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_SGLANG_VERSIONS = {
    (0, 4): "0.4.7", (5, 12): "0.5.12", (5, 19): "0.5.19", (5, 22): "0.5.22", (5, 23): "0.5.23",
}  # fmt: skip
_VLLM_VERSIONS = {(10, 0): "0.10.0", (23, 0): "0.23.0", (33, 0): "0.33.0"}


def engine_version(w: SimulatedWorker) -> str:
    """The engine version string the format stands for."""
    table = _SGLANG_VERSIONS if w.fmt.engine == "sglang" else _VLLM_VERSIONS
    return table[w.fmt.version]


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
            out["cache_hit_rate"].add_metric(labels, s.hit_rate)
            out["max_total_num_tokens"].add_metric(labels, c.capacity_tokens)
            out["page_size"].add_metric(labels, c.page_size)
        yield from out.values()

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
        for st in w.ranks:
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


def server_info(w: SimulatedWorker) -> dict[str, Any]:
    """SGLang `GET /server_info`, with the `kv_events` block from 0.5.14 and sources from 0.5.22."""
    c, v = w.cfg, w.fmt.version
    info: dict[str, Any] = {
        "model_path": c.model_name,
        "served_model_name": c.model_name,
        "version": engine_version(w),
        "dp_size": c.dp_size,
        "enable_dp_attention": c.dp_attention,
        "nnodes": c.nnodes,
        "node_rank": c.node_rank,
        "page_size": c.page_size,
        "max_total_num_tokens": c.capacity_tokens,
        "max_running_requests": c.max_running_requests,
        "kv_events_config": json.dumps(
            {"publisher": "zmq", "endpoint": f"tcp://*:{w.kv_base}", "topic": c.topic}
        ),
    }
    if v < (5, 14):
        return info
    block: dict[str, Any] = {
        "publisher": "zmq",
        "endpoint_host": "*",  # what the engine's default `tcp://*:port` reports; use the URL's host
        "endpoint_port_base": w.kv_base,
        "topic": c.topic,
        "block_size": c.page_size,
        "dp_size": c.dp_size,
    }
    if w.load_base is not None and v >= (5, 19):
        block["load_endpoint_port_base"] = w.load_base
        block["load_topic"] = "load"
    if v >= (5, 22):
        if w.replay_base is not None:
            block["replay_endpoint_port_base"] = w.replay_base
        sources = []
        for st in w.ranks:
            src: dict[str, Any] = {
                "dp_rank": st.rank,
                "endpoint": f"tcp://{c.host}:{st.port}",
                "topic": c.topic,
                "block_size": c.page_size,
            }
            if st.replay_port is not None:
                src["replay_endpoint"] = f"tcp://{c.host}:{st.replay_port}"
            sources.append(src)
        info["kv_event_sources"] = sources
    info["kv_events"] = block
    return info


def kv_event_sources(w: SimulatedWorker) -> dict[str, Any]:
    """vLLM 0.33 `GET /kv_event_sources`: `{dp_rank: KVEventsConfig}` with resolved endpoints."""
    c = w.cfg
    return {
        str(st.rank): {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://{c.host}:{st.port}",
            "replay_endpoint": None
            if st.replay_port is None
            else f"tcp://{c.host}:{st.replay_port}",
            "buffer_steps": c.buffer_steps,
            "hwm": c.hwm,
            "max_queue_size": 100_000,
            "topic": c.topic,
        }
        for st in w.ranks
    }


class SimHttpServer:
    """aiohttp on a private loop in a thread; `start()` returns the bound port."""

    def __init__(self, w: SimulatedWorker, host: str, port: int) -> None:
        self.w = w
        self.host = host
        self.port = port
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_EngineMetrics(w))
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_ev: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        if self.w.fmt.engine == "sglang":
            app.router.add_get("/server_info", self._server_info)
        elif self.w.fmt.version >= (33, 0):
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

    async def _main(self) -> None:
        runner = web.AppRunner(self._app(), access_log=None)
        try:
            await runner.setup()
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
            self.port = runner.addresses[0][1]
            self._loop = asyncio.get_running_loop()
            self._stop_ev = asyncio.Event()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            await runner.cleanup()
            return
        self._ready.set()
        await self._stop_ev.wait()
        await runner.cleanup()

    def start(self) -> int:
        """Serve in a background thread; the bound port (OSError if it cannot bind)."""
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        self._ready.wait(5.0)
        if self._error is not None or self._loop is None:
            raise OSError(f"http_port: cannot serve on {self.host}:{self.port}: {self._error}")
        return self.port

    def stop(self) -> None:
        """Stop serving; idempotent."""
        if self._loop is not None and self._stop_ev is not None:
            self._loop.call_soon_threadsafe(self._stop_ev.set)
            self._loop = None
        if self._thread is not None:
            self._thread.join(2.0)
            self._thread = None
