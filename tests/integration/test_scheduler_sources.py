"""Scheduler sources on real sockets: /metrics over HTTP, and the SGLang 0.5.23 load PUB,
KvMetrics PUSH and FPM PUB replayed from the capture bytes over ZMQ on 127.0.0.1 / ipc."""

from __future__ import annotations

import asyncio
import base64
import json
import pickle
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from kvobserve.config import WorkerConfig
from kvobserve.simulate.ports import free_port
from kvobserve.sources.passthrough import parse_engine_metrics, relabel
from kvobserve.sources.plan import rank_endpoint, scheduler_specs
from kvobserve.sources.scheduler import (
    FpmSubscriber,
    KvMetricsPull,
    LoadSubscriber,
    MetricsScrape,
    SchedulerSources,
    SchedulerValues,
    merge_values,
)
from tests.polling import until_async

pytestmark = pytest.mark.integration

CAPTURES = Path(__file__).parent.parent / "fixtures" / "engine-captures" / "sglang-0.5.23"

SG = 'engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0"'


def sglang_gauge(name: str, help_text: str, v0: float, v1: float) -> str:
    """One SGLang scheduler gauge as exposed: DP rank 0 on tp_rank 0, DP rank 1 on tp_rank 4."""
    return (
        f"# HELP sglang:{name} {help_text}\n# TYPE sglang:{name} gauge\n"
        f'sglang:{name}{{dp_rank="0",{SG},tp_rank="0"}} {v0}\n'
        f'sglang:{name}{{dp_rank="1",{SG},tp_rank="4"}} {v1}\n'
    )


SGLANG_METRICS = (
    sglang_gauge("num_running_reqs", "The number of running requests.", 7.0, 3.0)
    + sglang_gauge("num_queue_reqs", "The number of requests in the waiting queue.", 2.0, 0.0)
    + sglang_gauge("token_usage", "The token usage.", 0.4375, 0.125)
    + sglang_gauge("cache_hit_rate", "The prefix cache hit rate.", 0.61, 0.25)
    + sglang_gauge("max_total_num_tokens", "Maximum total number of tokens.", 65536.0, 65536.0)
    + """\
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="Qwen/Qwen3-8B"} 3.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="Qwen/Qwen3-8B"} 5.0
sglang:time_to_first_token_seconds_sum{model_name="Qwen/Qwen3-8B"} 1.25
sglang:time_to_first_token_seconds_count{model_name="Qwen/Qwen3-8B"} 5.0
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="Qwen/Qwen3-8B"} 123456.0
"""
)


VL = 'model_name="meta-llama/Llama-3.1-8B"'
CACHE_CFG = 'block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="{}",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="{}"'


def vllm_family(name: str, typ: str, help_text: str, by_engine: dict[int, float]) -> list[str]:
    """One vLLM family, one sample per DP engine."""
    head = [f"# HELP {name} {help_text}", f"# TYPE {name} {typ}"]
    return head + [f'{name}{{engine="{e}",{VL}}} {v}' for e, v in by_engine.items()]


def vllm_metrics(hits0: float, queries0: float, rank1_counters: bool, usage_name: str) -> str:
    """vLLM V1 /metrics with two DP engines."""
    hits, queries = {0: hits0}, {0: queries0}
    if rank1_counters:
        hits[1], queries[1] = 9.0, 10.0
    lines = [
        *vllm_family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", {0: 5.0, 1: 2.0}),
        *vllm_family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", {0: 1.0, 1: 0.0}),
        *vllm_family(usage_name, "gauge", "KV-cache usage. 1 means 100 percent usage.", {0: 0.25, 1: 0.5}),
        *vllm_family("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in tokens.", queries),
        *vllm_family("vllm:prefix_cache_queries_created", "gauge", "Prefix cache queries, in tokens.", {0: 1.7e9}),
        *vllm_family("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in tokens.", hits),
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        f"vllm:cache_config_info{{{CACHE_CFG.format(0, 2048)}}} 1.0",
        f"vllm:cache_config_info{{{CACHE_CFG.format(1, 1024)}}} 1.0",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def vals(v: SchedulerValues) -> tuple[Any, ...]:
    return (v.running_requests, v.queued_requests, v.token_usage_ratio, v.cache_hit_ratio, v.max_total_tokens)  # fmt: skip


def load_capture(name: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    frames = [
        json.loads(line) for line in (CAPTURES / name / "frames.jsonl").read_text().splitlines()
    ]
    return frames, json.loads((CAPTURES / name / "expected.json").read_text())


def raw_frames(line: dict[str, Any]) -> list[bytes]:
    return [base64.b64decode(f) for f in line["frames"]]


def resending(cond: Callable[[], bool], send: Callable[[], object]) -> Callable[[], bool]:
    """A check that sends again while `cond` does not hold (a PUB drops until the subscription
    arrives)."""

    def check() -> bool:
        if cond():
            return True
        send()
        return False

    return check


class MetricsServer:
    def __init__(self) -> None:
        self.body, self.status, self.url = "", 200, ""

    async def handle(self, request: web.Request) -> web.Response:
        return web.Response(status=self.status, text=self.body, content_type="text/plain")


@pytest.fixture
async def metrics_server() -> AsyncIterator[MetricsServer]:
    srv = MetricsServer()
    app = web.Application()
    app.router.add_get("/metrics", srv.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    srv.url = f"http://127.0.0.1:{runner.addresses[0][1]}/metrics"
    try:
        yield srv
    finally:
        await runner.cleanup()


@pytest.fixture
def ctx() -> Any:
    c = zmq.asyncio.Context()
    try:
        yield c
    finally:
        c.destroy(linger=0)


async def test_sglang_metrics_scrape(metrics_server: MetricsServer) -> None:
    metrics_server.body = SGLANG_METRICS
    src = MetricsScrape(metrics_server.url, "sglang", clock=lambda: 100.0)
    try:
        await src.scrape_once()
    finally:
        await src.close()
    got = src.values()
    assert src.up and sorted(got) == [0, 1]
    assert vals(got[0]) == (7.0, 2.0, 0.4375, 0.61, 65536.0)
    assert vals(got[1]) == (3.0, 0.0, 0.125, 0.25, 65536.0)
    assert got[0].source == "metrics" and got[0].updated_at == 100.0
    assert {f.name for f in src.families} >= {"sglang:num_running_reqs", "sglang:prompt_tokens"}


async def test_vllm_metrics_scrape_delta_hit_ratio(metrics_server: MetricsServer) -> None:
    src = MetricsScrape(metrics_server.url, "vllm", clock=lambda: 1.0)
    try:
        metrics_server.body = vllm_metrics(400.0, 1000.0, False, "vllm:kv_cache_usage_perc")
        await src.scrape_once()
        first = src.values()
        assert vals(first[0]) == (5.0, 1.0, 0.25, None, 32768.0)  # no delta yet
        assert vals(first[1]) == (2.0, 0.0, 0.5, None, 16384.0)
        metrics_server.body = vllm_metrics(650.0, 1500.0, True, "vllm:kv_cache_usage_perc")
        await src.scrape_once()
        assert src.values()[0].cache_hit_ratio == 0.5  # (650-400) / (1500-1000)
        assert src.values()[1].cache_hit_ratio is None  # first counters seen for engine 1
        metrics_server.body = vllm_metrics(10.0, 20.0, True, "vllm:kv_cache_usage_perc")
        await src.scrape_once()  # counters went back: engine restarted, no bogus ratio
        assert src.values()[0].cache_hit_ratio == 0.5
        metrics_server.status = 503
        await src.scrape_once()
        assert not src.up and src.errors["status"] == 1
    finally:
        await src.close()
        await src.close()


def test_vllm_older_usage_name_and_malformed_text() -> None:
    src = MetricsScrape("http://unused/metrics", "vllm", clock=lambda: 1.0)
    src.ingest(vllm_metrics(1.0, 2.0, False, "vllm:gpu_cache_usage_perc"))
    assert src.values()[1].token_usage_ratio == 0.5
    src.ingest("vllm:num_requests_running{engine=0 5\n")
    assert src.errors["parse"] == 1 and not src.up
    assert src.values()[1].token_usage_ratio == 0.5  # kept


def test_sglang_without_dp_rank_label_is_rank_0() -> None:
    text = '# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name="m",tp_rank="0"} 4.0\n'
    assert parse_engine_metrics(text, "sglang").values == {0: {"running_requests": 4.0}}


async def test_scrape_connection_refused_counts() -> None:
    port = free_port()  # of this worker's block: nobody listens there
    src = MetricsScrape(f"http://127.0.0.1:{port}/metrics", "sglang", timeout_s=1.0)
    try:
        await src.scrape_once()
    finally:
        await src.close()
    assert src.errors["connection"] == 1 and src.values() == {}


def bind_consecutive_pubs(ctx: zmq.asyncio.Context, n: int) -> tuple[int, list[zmq.asyncio.Socket]]:
    """n PUB sockets bound on consecutive free ports (base + r), like an engine's ranks."""
    for _ in range(50):
        probe = ctx.socket(zmq.PUB)
        base = probe.bind_to_random_port("tcp://127.0.0.1")
        socks = [probe]
        try:
            for r in range(1, n):
                s = ctx.socket(zmq.PUB)
                socks.append(s)
                s.bind(f"tcp://127.0.0.1:{base + r}")
            return base, socks
        except zmq.ZMQError:
            for s in socks:
                s.close(linger=0)
    raise AssertionError("no consecutive free ports")


async def test_load_pub_capture(ctx: zmq.asyncio.Context) -> None:
    lines, expected = load_capture("load")
    base, pubs = bind_consecutive_pubs(ctx, 2)
    eps = [rank_endpoint(f"tcp://127.0.0.1:{base}", r) for r in (0, 1)]
    src = LoadSubscriber(eps, [0, 1], ctx=ctx)
    await src.start()
    try:
        assert src.endpoints == [f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"]
        for line, exp in zip(lines, expected, strict=True):
            m, r = exp["message"], exp["dp_rank"]
            want = (m["num_running_reqs"], m["num_waiting_reqs"], m["num_tokens"] / m["max_total_num_tokens"], None, m["max_total_num_tokens"])  # fmt: skip
            frames = raw_frames(line)
            # PUB drops until the subscription arrives: re-send until this rank shows the values
            await until_async(
                resending(
                    lambda r=r, want=want: r in src.values() and vals(src.values()[r]) == want,
                    lambda r=r, frames=frames: pubs[r].send_multipart(frames),
                ),
                5.0,
                f"rank {r} shows the capture's values {want}",
            )
        assert sum(src.errors.values()) == 0
        pubs[0].send_multipart([b"load", b"\x00" * 7, b"x"])  # short seq frame
        pubs[0].send_multipart([b"load", b"\x00" * 8, b"\xc1"])  # not msgpack
        await until_async(
            lambda: src.errors["seq_length"] == 1 and src.errors["msgpack"] == 1,
            5.0,
            "one short seq frame and one bad msgpack counted",
        )
    finally:
        await src.close()
        await src.close()
        for s in pubs:
            s.close(linger=0)


async def test_a_load_publisher_that_stops_is_down_until_it_sends_again(
    ctx: zmq.asyncio.Context,
) -> None:
    """Issue 21: a killed engine's load source said "up: receiving" for ever. Silent for the
    threshold (10 intervals, here the 3 s floor at 0.1 s), it is down with the reason."""
    (line, *_), _ = load_capture("load")
    base, pubs = bind_consecutive_pubs(ctx, 1)
    sources = SchedulerSources(
        [scheduler_specs(WorkerConfig("w", "sglang"), (0,), f"tcp://127.0.0.1:{base}")[0]],
        "sglang",
        interval_s=0.1,
        ctx=ctx,
    )
    (src,) = sources.sources
    assert sources.silent_after_s == 3.0  # MIN_SILENT_S: a 1 s heartbeat is not silence
    await sources.start()
    try:
        frames = raw_frames(line)
        await until_async(
            resending(lambda: src.health.state == "up", lambda: pubs[0].send_multipart(frames)),
            5.0,
            "the load source up",
        )
        sources.check_silence()
        assert src.health.state == "up"  # it just sent
        t0 = asyncio.get_running_loop().time()

        def checked_down() -> bool:
            sources.check_silence()  # what the collector does every interval
            return src.health.state == "down"

        await until_async(checked_down, 10, "the silent source down")
        assert asyncio.get_running_loop().time() - t0 >= 2.5  # not before the threshold
        assert (
            src.health.reason == "no message for 3 s (it sends every second while its engine runs)"
        )
        await until_async(
            resending(lambda: src.health.state == "up", lambda: pubs[0].send_multipart(frames)),
            5.0,
            "the load source up",
        )
        assert src.health.reason == "receiving"
    finally:
        await sources.close()
        for s in pubs:
            s.close(linger=0)


async def test_kv_metrics_pull_capture_and_pickle_refused(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    lines, expected = load_capture("kv_metrics")
    endpoint = f"ipc://{tmp_path}/kv-metrics"
    src = KvMetricsPull(endpoint, ctx=ctx, clock=lambda: 5.0)
    await src.start()
    push = ctx.socket(zmq.PUSH)
    push.connect(endpoint)
    try:
        for line, exp in zip(lines, expected, strict=True):
            m = exp["message"]
            want = (m["request_active_slots"], m["num_requests_waiting"], m["gpu_cache_usage_perc"], m["gpu_prefix_cache_hit_rate"], m["kv_total_blocks"])  # fmt: skip
            await push.send_multipart(raw_frames(line))
            r = exp["dp_rank"]
            await until_async(
                lambda r=r, want=want: r in src.values() and vals(src.values()[r]) == want,
                5.0,
                f"rank {r} shows the capture's values {want}",
            )
        before = src.values()
        # the engine's default: a pickled object. Refused (never unpickled) and counted.
        await push.send(pickle.dumps({"request_active_slots": 99, "data_parallel_rank": 0}))
        await push.send(b"\x93\x01\x02")  # msgpack, wrong shape
        await until_async(
            lambda: src.errors["pickle_refused"] == 1 and src.errors["schema"] == 1,
            5.0,
            "one pickle refused and one bad schema counted",
        )
        assert {r: vals(v) for r, v in src.values().items()} == {
            r: vals(v) for r, v in before.items()
        }
        assert src.messages_total == len(lines) + 2
    finally:
        push.close(linger=0)
        await src.close()
        await src.close()


async def test_fpm_sub_capture(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    lines, expected = load_capture("forward_pass_metrics")
    base = f"ipc://{tmp_path}/fpm"
    pubs = []
    for r in (0, 1):
        s = ctx.socket(zmq.PUB)
        s.bind(f"{base}.{r}")
        pubs.append(s)
    src = FpmSubscriber([rank_endpoint(base, r, dotted_ipc=True) for r in (0, 1)], [0, 1], ctx=ctx)
    await src.start()
    try:
        for line, exp in zip(lines, expected, strict=True):
            sch, q = exp["message"]["scheduled_requests"], exp["message"]["queued_requests"]
            want = (sch["num_prefill_requests"] + sch["num_decode_requests"], q["num_prefill_requests"] + q["num_decode_requests"], None, None, None)  # fmt: skip
            r, frames = exp["dp_rank"], raw_frames(line)
            await until_async(
                resending(
                    lambda r=r, want=want: r in src.values() and vals(src.values()[r]) == want,
                    lambda r=r, frames=frames: pubs[r].send_multipart(frames),
                ),
                5.0,
                f"rank {r} shows the capture's values {want}",
            )
        assert vals(src.values()[0]) == (0, 0, None, None, None)  # the idle heartbeat came last
    finally:
        await src.close()
        for s in pubs:
            s.close(linger=0)


def test_merge_freshest_source_wins_per_field() -> None:
    scrape = {
        0: SchedulerValues(7.0, 2.0, 0.4, 0.6, 65536.0, "metrics", 10.0),
        1: SchedulerValues(1.0, source="metrics", updated_at=10.0),
    }
    fpm = {0: SchedulerValues(9, 0, source="fpm", updated_at=12.0)}
    load = {0: SchedulerValues(8, 1, 0.5, None, 65536, source="load", updated_at=11.0)}
    merged = merge_values([scrape, fpm, load])
    assert vals(merged[0]) == (9, 0, 0.5, 0.6, 65536)
    # every source that reported the rank (stable, not the freshest one of the moment)
    assert (merged[0].source, merged[0].updated_at) == ("fpm+load+metrics", 12.0)
    assert vals(merged[1]) == (1.0, None, None, None, None) and merged[1].source == "metrics"


async def test_scheduler_sources_for_a_worker(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    w = WorkerConfig(
        id="w", engine="sglang", kv_endpoint="tcp://10.0.0.5:5557", dp_size=2,
        metrics_url="http://10.0.0.5:30000/metrics", kv_metrics_endpoint=f"ipc://{tmp_path}/m",
        fpm_endpoint="tcp://10.0.0.5:7000",
    )  # fmt: skip
    specs = scheduler_specs(w, range(2), load_base="tcp://10.0.0.5:5561")
    assert [(s.source, e) for s in specs for e in s.endpoints] == [
        ("metrics", "http://10.0.0.5:30000/metrics"),
        ("load", "tcp://10.0.0.5:5561"),
        ("load", "tcp://10.0.0.5:5562"),
        ("kv_metrics", f"ipc://{tmp_path}/m"),
        ("fpm", "tcp://10.0.0.5:7000"),
        ("fpm", "tcp://10.0.0.5:7001"),
    ]
    srcs = SchedulerSources(specs, w.engine, ctx=ctx)
    assert [type(s).__name__ for s in srcs.sources] == [
        "MetricsScrape", "LoadSubscriber", "KvMetricsPull", "FpmSubscriber"
    ]  # fmt: skip
    lines, _ = load_capture("kv_metrics")
    kv = srcs.sources[2]
    await kv.start()  # only the PULL: the other endpoints are not reachable here
    push = ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{tmp_path}/m")
    try:
        await push.send_multipart(raw_frames(lines[0]))
        await until_async(lambda: 0 in srcs.values(), 5.0, "rank 0's values from the PULL")
        assert srcs.values()[0].running_requests == 7 and srcs.values()[0].source == "kv_metrics"
    finally:
        push.close(linger=0)
        await srcs.close()
        await srcs.close()


def test_passthrough_relabels() -> None:
    fams = parse_engine_metrics(SGLANG_METRICS, "sglang").families
    out = relabel(fams, {"worker_id": "w1", "node_rank": "0", "tp_rank": "x"})
    sample = next(s for f in out for s in f.samples if s.name == "sglang:num_running_reqs")
    assert sample.labels["worker_id"] == "w1" and sample.labels["exported_tp_rank"] == "0"
    assert sample.labels["dp_rank"] == "0" and sample.value == 7.0  # the engine's own labels stay
    assert [f.name for f in out] == [f.name for f in fams]  # copies: the scrape is not changed
    assert all("worker_id" not in s.labels for f in fams for s in f.samples)
