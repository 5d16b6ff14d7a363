"""Discovery per engine version, from node 0's URL: real simulated engines over HTTP on 127.0.0.1.

SGLang 0.5.12 has only the raw `kv_events_config` string, 0.5.22 reports attention DP as
`dp_size 1, attn_dp_size N`, 0.5.23 the `kv_events` block; vLLM lists per API server the ranks it
manages (0.31+) and has no such route before. Hosts stay the engine's own (`*`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from kvobserve.simulate import SimConfig, SimulatorGroup, nodes_of
from kvobserve.sources.discovery import discover, discover_urls
from kvobserve.sources.discovery_parse import DiscoveryError, parse_sglang_server_info

pytestmark = pytest.mark.integration
HOSTS = ("127.0.0.1", "127.0.0.2")


@pytest.fixture
def group() -> Iterator[list[SimulatorGroup]]:
    started: list[SimulatorGroup] = []
    yield started
    for g in started:
        g.stop()


def _start(started: list[SimulatorGroup], **kw: Any) -> SimulatorGroup:
    kw.setdefault("start_delay_s", 60.0)  # discovery only: nothing needs to publish
    kw.setdefault("dp_size", 8)
    cfg = SimConfig(nnodes=2, topic="kv-events", page_size=32, **kw)
    g = SimulatorGroup(nodes_of(cfg, HOSTS)).start()
    started.append(g)
    return g


@pytest.mark.parametrize("fmt", ["sglang-0.5.12", "sglang-0.5.22", "sglang-0.5.23"])
async def test_sglang_dp_attention_over_two_nodes_from_node_0(
    fmt: str, group: list[SimulatorGroup]
) -> None:
    load = None if fmt == "sglang-0.5.12" else 0  # the load PUB exists from 0.5.19
    n0, _ = _start(group, format=fmt, load_port=load).workers
    found = await discover(f"http://127.0.0.1:{n0.http_port}", "sglang")
    assert (found.dp_size, found.dp_attention, found.nnodes) == (8, True, 2)
    assert found.version == fmt.removeprefix("sglang-")
    assert [s.endpoint for s in found.sources] == [f"tcp://*:{n0.kv_base + r}" for r in range(8)]
    assert [s.replay_endpoint for s in found.sources] == [
        f"tcp://*:{(n0.replay_base or 0) + r}" for r in range(8)
    ]
    assert {s.topic for s in found.sources} == {"kv-events"} and found.block_size == 32
    if load is None:
        assert found.load_endpoint_base is None
    else:
        assert found.load_endpoint_base == f"tcp://*:{n0.load_base}"
    assert found.notes == ()


async def test_sglang_grpc_mode_lists_node_0_sources_bound(group: list[SimulatorGroup]) -> None:
    n0, _ = _start(group, format="sglang-0.5.22", grpc_port=31000).workers
    found = await discover(f"http://127.0.0.1:{n0.http_port}", "sglang")
    # node 0 lists its ranks 0-3 as bound (127.0.0.1); 4-7 come from the kv_events bases
    assert [s.endpoint for s in found.sources] == [f"tcp://*:{n0.kv_base + r}" for r in range(8)]


async def test_sglang_0_5_12_pure_dp_publishes_once(group: list[SimulatorGroup]) -> None:
    cfg = SimConfig(format="sglang-0.5.12", dp_size=4, dp_attention=False, start_delay_s=60.0)
    g = SimulatorGroup([cfg]).start()
    group.append(g)
    (w,) = g.workers
    found = await discover(f"http://127.0.0.1:{w.http_port}", "sglang")
    # every scheduler offsets by attn_dp_rank 0: one publisher binds rank 0's port
    assert found.dp_size == 1 and found.dp_attention is False
    assert [s.endpoint for s in found.sources] == [f"tcp://*:{w.kv_base}"]
    (note,) = found.notes
    assert "pure DP: all 4 schedulers publish on rank 0's port" in note
    assert [e.kind for e in w.endpoints() if e.kind == "kv"] == ["kv"]  # what the engine did


@pytest.mark.parametrize("lb", ["internal", "hybrid"])
async def test_vllm_two_nodes_merged_with_block_size(lb: str, group: list[SimulatorGroup]) -> None:
    g = _start(group, format="vllm-0.33", dp_size=4, dp_lb=lb, http_port=0)
    n0, n1 = g.workers
    urls = [f"http://127.0.0.1:{n0.http_port}"]
    if lb == "hybrid":  # each API server lists its own ranks: ask both
        alone = await discover(urls[0], "vllm")
        assert [s.dp_rank for s in alone.sources] == [0, 1]
        urls.append(f"http://127.0.0.2:{n1.http_port}")
    found = await discover_urls(urls, "vllm")
    assert found.dp_size == 4 and found.block_size == 32
    assert [s.endpoint for s in found.sources] == [f"tcp://*:{n0.kv_base + r}" for r in range(4)]
    assert [s.block_size for s in found.sources] == [32] * 4


async def test_vllm_before_0_31_names_the_settings_to_give(group: list[SimulatorGroup]) -> None:
    g = SimulatorGroup([SimConfig(format="vllm-0.23", start_delay_s=60.0)]).start()
    group.append(g)
    with pytest.raises(DiscoveryError) as info:
        await discover(f"http://127.0.0.1:{g.workers[0].http_port}", "vllm")
    msg = str(info.value)
    assert "HTTP 404 on /kv_event_sources" in msg and "vLLM before 0.31" in msg
    assert all(k in msg for k in ("kv_endpoint", "replay_endpoint", "dp_size"))


async def test_vllm_merge_needs_every_rank() -> None:
    app = web.Application()
    bodies = {
        "/a/kv_event_sources": {"0": {"endpoint": "tcp://*:5557"}},
        "/b/kv_event_sources": {"2": {"endpoint": "tcp://*:5559"}},
    }

    async def handle(request: web.Request) -> web.Response:
        body = bodies.get(request.path)
        return web.json_response(body) if body else web.Response(status=404)

    app.router.add_get("/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        with pytest.raises(DiscoveryError) as info:
            await discover_urls([f"{base}/a", f"{base}/b"], "vllm")
        assert info.value.field == "dp_rank" and "ranks [1]" in str(info.value)
    finally:
        await runner.cleanup()


RAW_CASES = [
    ({"kv_events_config": None}, "kv_events", "null"),
    ({"kv_events_config": "null"}, "kv_events", "null"),
    ({"kv_events_config": "{oops"}, "kv_events_config", "not JSON"),
    ({"kv_events_config": json.dumps({"endpoint": "tcp://*:1"})}, "kv_events_config.publisher", ""),
    (
        {
            "kv_events_config": json.dumps({"publisher": "zmq", "endpoint": "ipc:///tmp/kv"}),
            "dp_size": 2,
            "enable_dp_attention": True,
        },
        "kv_events_config.endpoint",
        "only tcp:// and inproc://",
    ),
]


@pytest.mark.parametrize(("body", "field", "fragment"), RAW_CASES)
def test_raw_config_errors_name_the_field(body: dict[str, Any], field: str, fragment: str) -> None:
    with pytest.raises(DiscoveryError) as info:
        parse_sglang_server_info("http://h:30000/server_info", body)
    assert info.value.field == field and fragment in info.value.detail


def test_raw_config_defaults_and_explicit_host() -> None:
    raw = {"publisher": "zmq", "endpoint": "tcp://10.0.0.5:6000", "topic": "t"}
    body = {"kv_events_config": json.dumps(raw), "dp_size": 2, "enable_dp_attention": True}
    found = parse_sglang_server_info("http://h:30000/server_info", body)
    assert [s.endpoint for s in found.sources] == ["tcp://10.0.0.5:6000", "tcp://10.0.0.5:6001"]
    assert [s.replay_endpoint for s in found.sources] == [None, None]
    default = parse_sglang_server_info(
        "http://h:30000/server_info", {"kv_events_config": '{"publisher": "zmq"}'}
    )
    assert [s.endpoint for s in default.sources] == ["tcp://*:5557"]  # KVEventsConfig default
