"""A simulated worker's /metrics, discovery endpoints and SGLang side channels, over real sockets."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvobserve.simulate import SimConfig, SimulatedWorker

pytestmark = pytest.mark.integration


async def _get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status, await resp.text()


def _samples(text: str) -> dict[tuple[str, str], float]:
    """(sample name, rank label) -> value."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            rank = s.labels.get("dp_rank", s.labels.get("engine", ""))
            out[(s.name, rank)] = s.value
    return out


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.destroy(linger=0)


async def test_sglang_metrics_discovery_and_side_channels(ctx: zmq.Context[Any]) -> None:
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind("tcp://127.0.0.1:0")  # the consumer binds; the engine's PUSH connects
    kv_metrics = pull.getsockopt_string(zmq.LAST_ENDPOINT)
    cfg = SimConfig(format="sglang-0.5.23", topic="kv-events", rate=200, capacity_tokens=4096,
                    load_port=0, kv_metrics_endpoint=kv_metrics, side_interval_s=0.05)  # fmt: skip
    w = SimulatedWorker(cfg).start()
    try:
        base = f"http://127.0.0.1:{w.http_port}"
        status, text = await _get(f"{base}/metrics")
        assert status == 200
        s = _samples(text)
        for r in ("0", "1"):
            assert s[("sglang:max_total_num_tokens", r)] == 4096
            assert 0 <= s[("sglang:token_usage", r)] <= 1
            assert ("sglang:num_running_reqs", r) in s and ("sglang:cache_hit_rate", r) in s

        status, text = await _get(f"{base}/server_info")
        info = json.loads(text)
        kv = info["kv_events"]
        assert (kv["endpoint_port_base"], kv["replay_endpoint_port_base"]) == (
            w.kv_base,
            w.replay_base,
        )
        assert (kv["dp_size"], kv["topic"], kv["load_endpoint_port_base"]) == (
            2,
            "kv-events",
            w.load_base,
        )
        assert "kv_event_sources" not in info  # only in gRPC mode (grpc_port)
        assert (await _get(f"{base}/kv_event_sources"))[0] == 404
        end = time.monotonic() + 5
        while not all(s[("sglang:num_used_tokens", r)] for r in ("0", "1")):  # requests running
            assert time.monotonic() < end, "no running request holds a page"
            s = _samples((await _get(f"{base}/metrics"))[1])
        for r in ("0", "1"):  # usage = tokens held by running requests / capacity
            used = s[("sglang:num_used_tokens", r)]
            assert 0 < used <= 4096 and s[("sglang:token_usage", r)] == used / 4096

        load = ctx.socket(zmq.SUB)
        load.setsockopt(zmq.LINGER, 0)
        load.setsockopt(zmq.SUBSCRIBE, b"load")
        load.connect(next(e.url for e in w.endpoints() if e.kind == "load" and e.dp_rank == 1))
        end = time.monotonic() + 5
        stat: list[Any] = []
        while not stat:
            assert time.monotonic() < end, "no LoadStat"
            if load.poll(100):
                topic, _, payload = load.recv_multipart()
                assert topic == b"load"
                stat = msgspec.msgpack.decode(payload)
        load.close(0)
        assert stat[0] == "LoadStat" and len(stat) == 11 and stat[4] == 4096 and stat[5] == 1

        assert pull.poll(5000), "no KvMetrics"
        km = msgspec.msgpack.decode(pull.recv())
        assert km[0] == "KvMetrics" and len(km) == 9 and km[4] == 4096  # kv_total_blocks: tokens
        assert km[3] == int(km[6] * 4096)  # kv_active_blocks = usage * capacity, in tokens
    finally:
        w.stop()
        pull.close(0)


async def test_vllm_metrics_and_kv_event_sources() -> None:
    w = SimulatedWorker(SimConfig(format="vllm-0.33", topic="kv-events", rate=100)).start()
    try:
        base = f"http://127.0.0.1:{w.http_port}"
        s = _samples((await _get(f"{base}/metrics"))[1])
        for r in ("0", "1"):
            assert ("vllm:num_requests_running", r) in s and ("vllm:num_requests_waiting", r) in s
            assert 0 <= s[("vllm:kv_cache_usage_perc", r)] <= 1
            assert (
                s[("vllm:prefix_cache_hits_total", r)] <= s[("vllm:prefix_cache_queries_total", r)]
            )
        status, text = await _get(f"{base}/kv_event_sources")
        sources = json.loads(text)
        assert status == 200 and sorted(sources) == ["0", "1"]
        # the configured endpoint offset by the rank: the wildcard stays a wildcard
        assert sources["1"]["endpoint"] == f"tcp://*:{w.kv_base + 1}"
        assert sources["1"]["replay_endpoint"] == f"tcp://*:{(w.replay_base or 0) + 1}"
        assert "block_size" not in sources["1"]
        assert sources["0"]["topic"] == "kv-events"
        assert (await _get(f"{base}/server_info"))[0] == 404
    finally:
        w.stop()
