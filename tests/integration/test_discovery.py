"""Discovery against a real aiohttp server on 127.0.0.1 serving SGLang and vLLM shaped JSON."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kvobserve import cli
from kvobserve.simulate.ports import free_port
from kvobserve.sources.discovery import Rediscovery, discover
from kvobserve.sources.discovery_parse import (
    DiscoveredEngine,
    DiscoveredSource,
    DiscoveryError,
    parse_sglang_server_info,
)
from tests.polling import until_async

pytestmark = pytest.mark.integration

# SGLang 0.5.23 /server_info, trimmed to what discovery reads plus neighbours it must ignore
SGLANG_INFO: dict[str, Any] = {
    "model_path": "Qwen/Qwen3-8B",
    "version": "0.5.23",
    "page_size": 16,
    "kv_events": {
        "publisher": "zmq",
        "endpoint_host": "*",
        "endpoint_port_base": 5557,
        "topic": "kv-events",
        "block_size": 16,
        "dp_size": 4,
        "replay_endpoint_port_base": 5657,
        "load_endpoint_port_base": 5561,
        "load_topic": "load",
    },
}

VLLM_SOURCES: dict[str, Any] = {
    "0": {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5657",
        "buffer_steps": 10000,
        "hwm": 100000,
        "max_queue_size": 100000,
        "topic": "kv-events",
    },
    "1": {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://10.0.0.7:5558",
        "replay_endpoint": None,
        "topic": "kv-events",
    },
}


class Engine:
    """A fake engine HTTP server whose answers the test changes."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, str]] = {}
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        status, body = self.routes.get(request.path, (404, "not found"))
        return web.Response(status=status, text=body, content_type="application/json")

    def serve(self, path: str, body: Any, status: int = 200) -> None:
        self.routes[path] = (status, body if isinstance(body, str) else json.dumps(body))


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    eng = Engine()
    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", eng.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    eng.url = f"http://127.0.0.1:{port}"
    try:
        yield eng
    finally:
        await runner.cleanup()


async def test_sglang_wildcard_host_and_bases(engine: Engine) -> None:
    engine.serve("/server_info", SGLANG_INFO)
    found = await discover(engine.url, "sglang")
    assert found.dp_size == 4
    assert found.version == "0.5.23" and found.block_size == 16
    # a wildcard host stays one: "the node that owns the rank" (each collector's own host)
    assert [s.endpoint for s in found.sources] == [f"tcp://*:{5557 + r}" for r in range(4)]
    assert [s.replay_endpoint for s in found.sources] == [f"tcp://*:{5657 + r}" for r in range(4)]
    assert {s.topic for s in found.sources} == {"kv-events"}
    assert found.load_endpoint_base == "tcp://*:5561" and found.load_topic == "load"


async def test_sglang_prefers_kv_event_sources_and_fills_missing_ranks(engine: Engine) -> None:
    info = json.loads(json.dumps(SGLANG_INFO))
    info["kv_events"]["dp_size"] = 3
    info["kv_event_sources"] = [
        {"dp_rank": 1, "endpoint": "tcp://10.9.9.9:6001", "topic": "t1", "block_size": 32},
        {
            "dp_rank": 0,
            "endpoint": "ipc:///tmp/sgl/kv.0",
            "topic": "t0",
            "block_size": 32,
            "replay_endpoint": "ipc:///tmp/sgl/r.0",
        },
    ]
    engine.serve("/server_info", info)
    found = await discover(engine.url, "sglang")
    assert found.sources == (
        DiscoveredSource(0, "ipc:///tmp/sgl/kv.0", "ipc:///tmp/sgl/r.0", "t0", 32),
        DiscoveredSource(1, "tcp://10.9.9.9:6001", None, "t1", 32),
        DiscoveredSource(2, "tcp://*:5559", "tcp://*:5659", "kv-events", 16),
    )


def test_sglang_loopback_and_ipv6_wildcard_are_the_owning_node() -> None:
    body = {
        "kv_events": {
            "endpoint_host": "::",
            "endpoint_port_base": 7000,
            "topic": "",
            "block_size": 64,
            "dp_size": 1,
        },
        "kv_event_sources": [
            {"dp_rank": 1, "endpoint": "tcp://127.0.0.1:7001", "topic": "", "block_size": 64}
        ],
    }
    found = parse_sglang_server_info("http://[fd00::5]:30000/server_info", body)
    # `::` and the bound 127.0.0.1 (how SGLang reports a wildcard bind): the rank's own node
    assert [s.endpoint for s in found.sources] == ["tcp://*:7000", "tcp://*:7001"]
    assert found.dp_size == 2 and found.load_endpoint_base is None


async def test_sglang_falls_back_to_get_server_info(engine: Engine) -> None:
    engine.serve("/get_server_info", SGLANG_INFO)
    found = await discover(engine.url, "sglang")
    assert found.url.endswith("/get_server_info") and found.dp_size == 4


async def test_vllm_kv_event_sources(engine: Engine) -> None:
    engine.serve("/kv_event_sources", VLLM_SOURCES)
    found = await discover(engine.url + "/", "vllm")
    assert found == DiscoveredEngine(
        "vllm",
        engine.url + "/kv_event_sources",
        2,
        (
            DiscoveredSource(0, "tcp://*:5557", "tcp://*:5657", "kv-events", None),
            DiscoveredSource(1, "tcp://10.0.0.7:5558", None, "kv-events", None),
        ),
    )


@pytest.mark.parametrize(
    ("path", "body", "status", "engine_kind", "field"),
    [
        ("/server_info", {"kv_events": None}, 200, "sglang", "kv_events"),
        ("/server_info", "{not json", 200, "sglang", "body"),
        (
            "/server_info",
            {"kv_events": {"endpoint_host": "*", "topic": "", "dp_size": 2}},
            200,
            "sglang",
            "kv_events.endpoint_port_base",
        ),
        (
            "/server_info",
            {"kv_events": {"endpoint_host": "*", "endpoint_port_base": "5557", "dp_size": 2}},
            200,
            "sglang",
            "kv_events.endpoint_port_base",
        ),
        (
            "/server_info",
            {"kv_event_sources": [{"dp_rank": "0", "endpoint": "tcp://h:1"}]},
            200,
            "sglang",
            "kv_event_sources[0].dp_rank",
        ),
        ("/server_info", {}, 500, "sglang", "status"),
        ("/kv_event_sources", {"0": {"topic": ""}}, 200, "vllm", "[0].endpoint"),
        ("/kv_event_sources", {"zero": {"endpoint": "tcp://h:1"}}, 200, "vllm", "['zero']"),
        (
            "/kv_event_sources",
            {"0": {"enable_kv_cache_events": False, "endpoint": "tcp://h:1"}},
            200,
            "vllm",
            "enable_kv_cache_events",
        ),
        ("/kv_event_sources", [], 200, "vllm", "body"),
        ("/nothing", {}, 200, "vllm", "status"),  # 404 on /kv_event_sources (vLLM < 0.33)
    ],
)
async def test_errors_name_url_and_field(
    engine: Engine, path: str, body: Any, status: int, engine_kind: str, field: str
) -> None:
    engine.serve(path, body, status)
    with pytest.raises(DiscoveryError) as info:
        await discover(engine.url, engine_kind)
    assert info.value.field == field
    assert engine.url in str(info.value) and field in str(info.value)


async def test_connection_refused_is_a_discovery_error() -> None:
    port = free_port()  # of this worker's block: nobody listens there
    with pytest.raises(DiscoveryError) as info:
        await discover(f"http://127.0.0.1:{port}", "vllm", timeout_s=2.0)
    assert info.value.field == "connection" and str(port) in str(info.value)


async def test_rediscovery_reports_moved_endpoints(engine: Engine) -> None:
    changes: list[tuple[DiscoveredEngine, DiscoveredEngine | None]] = []

    async def on_change(new: DiscoveredEngine, old: DiscoveredEngine | None) -> None:
        changes.append((new, old))

    engine.serve("/kv_event_sources", VLLM_SOURCES)
    red = Rediscovery(engine.url, "vllm", interval_s=0.01, on_change=on_change)
    try:
        assert await red.poll_once() is True  # first result counts as a change from nothing
        assert await red.poll_once() is False  # same endpoints
        moved = json.loads(json.dumps(VLLM_SOURCES))
        moved["0"]["endpoint"] = "tcp://*:6557"  # engine restarted on new ports
        engine.serve("/kv_event_sources", moved)
        assert await red.poll_once() is True
        assert changes[-1][0].sources[0].endpoint == "tcp://*:6557"
        assert changes[-1][1] is not None and changes[-1][1].sources[0].endpoint == "tcp://*:5557"
        engine.serve("/kv_event_sources", "garbage")
        assert await red.poll_once() is False
        assert (
            red.errors_total == 1 and red.last_error is not None and red.last_error.field == "body"
        )
        assert red.current is not None and red.current.sources[0].endpoint.endswith(":6557")  # kept
        # background loop: the next change arrives without calling poll_once
        engine.serve("/kv_event_sources", VLLM_SOURCES)
        await red.start()
        await red.start()  # idempotent
        await until_async(lambda: len(changes) >= 3, 5.0, "3 discovery changes", lambda: changes)
        assert len(changes) == 3 and changes[-1][0].sources[0].endpoint.endswith(":5557")
    finally:
        await red.close()
        await red.close()
    assert changes[0][1] is None and red.changes_total == 3


async def test_check_command_resolves_discovery(engine: Engine, tmp_path: Path) -> None:
    engine.serve("/server_info", SGLANG_INFO)
    cfg = tmp_path / "kvobserve.toml"
    cfg.write_text(
        f'[collector]\nnode_rank = 1\nnnodes = 2\nhost = "127.0.0.2"\n\n'
        f'[[worker]]\nid = "sg"\nengine = "sglang"\n'
        f'url = "{engine.url}"\ndp_attention = true\nleader = true\n'
        f'metrics_url = "{engine.url}/metrics"\n'
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvobserve", "check", "-c", str(cfg), "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    doc = json.loads(out)
    assert doc["collector"]["host"] == "127.0.0.2"
    (plan,) = doc["workers"]
    assert plan["dp_size"] == 4 and plan["watched_ranks"] == [2, 3]
    # this node's ranks at its own host; node 0's keep the advertised wildcard
    assert [s["endpoint"] for s in plan["streams"]] == [
        "tcp://*:5557", "tcp://*:5558", "tcp://127.0.0.2:5559", "tcp://127.0.0.2:5560"
    ]  # fmt: skip
    assert [(s["node_rank"], s["watched"]) for s in plan["streams"]] == [
        (0, False), (0, False), (1, True), (1, True)
    ]  # fmt: skip
    assert plan["streams"][3]["replay_endpoint"] == "tcp://127.0.0.2:5660"
    assert plan["probe_endpoints"] == []  # 5561 is the load PUB of rank 0 (SGLang `auto`)
    assert plan["notes"] == [
        "probe tcp://127.0.0.2:5561 skipped: it is the SGLang load publisher's port"
    ]
    assert plan["scheduler_sources"] == [
        {
            "source": "metrics",
            "endpoint": f"{engine.url}/metrics",
            "scope": "leader",
            "dp_rank": None,
        },
        *(
            {
                "source": "load",
                "endpoint": f"tcp://127.0.0.2:{5561 + r}",
                "scope": "rank",
                "dp_rank": r,
            }
            for r in (2, 3)
        ),
    ]


def test_check_command_config_error_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "kvobserve.toml"
    cfg.write_text('[[worker]]\nengine = "sglang"\nkv_endpoint = "tcp://h:1"\ndp_sise = 2\n')
    assert cli.main(["check", "-c", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "worker[0].dp_sise: unknown key (value 2)" in err
    cfg.write_text('[[worker]]\nengine = "sglang"\nkv_endpoint = "ipc:///tmp/kv"\ndp_size = 2\n')
    assert cli.main(["check", "-c", str(cfg), "--no-discovery"]) == 2
    assert "worker[0].kv_endpoint" in capsys.readouterr().err
