"""Multi-node simulated engines on two loopback hosts: who binds where, who serves which HTTP."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvobserve.simulate import SimConfig, SimulatedWorker, SimulatorGroup, nodes_of
from kvobserve.wire.kv_events import decode_message
from tests.polling import until

pytestmark = pytest.mark.integration
HOSTS = ("127.0.0.1", "127.0.0.2")


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.destroy(linger=0)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def _accepts(host: str, port: int) -> bool:
    """Whether a TCP connection to host:port is accepted (refused: nothing bound there)."""
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) == 0


def _ranks(text: str, name: str, label: str) -> set[int]:
    """The `label` values of every sample of metric `name`."""
    return {
        int(s.labels[label])
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    }


def _batches(ctx: zmq.Context[Any], url: str, wrong: str, n: int) -> list[int]:
    """Ranks of n batches from `url`, while a SUB on `wrong` (same port, other host) gets none."""
    subs = []
    for u in (url, wrong):
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(u)
        subs.append(s)
    got: list[int] = []
    end = time.monotonic() + 8
    try:
        while len(got) < n:
            assert time.monotonic() < end, f"{len(got)} batches from {url}"
            if subs[0].poll(200):
                got.append(decode_message(subs[0].recv_multipart()).dp_rank or 0)
            assert not subs[1].poll(0), f"a batch arrived on {wrong}"
    finally:
        for s in subs:
            s.close(0)
    return got


@pytest.mark.parametrize("fmt", ["sglang-0.5.12", "sglang-0.5.22", "sglang-0.5.23"])
def test_sglang_dp_attention_nodes_bind_on_their_own_hosts(
    fmt: str, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    load = 0 if fmt != "sglang-0.5.12" else None  # the load publisher exists from 0.5.19
    cfg = SimConfig(format=fmt, dp_size=8, nnodes=2, topic="kv-events", rate=100, load_port=load,
                    start_delay_s=0.3)  # fmt: skip
    with SimulatorGroup(nodes_of(cfg, HOSTS)) as g:
        n0, n1 = g.workers
        assert [st.rank for st in n1.ranks] == [4, 5, 6, 7] and n1.http_port is None
        bases = [b for b in (n0.kv_base, n0.replay_base, n0.load_base) if b is not None]
        for base in bases:  # KV PUB, replay ROUTER, load PUB: base + rank on the rank's node
            assert _accepts("127.0.0.2", base + 4) and not _accepts("127.0.0.1", base + 4)
            assert _accepts("127.0.0.1", base + 3) and not _accepts("127.0.0.2", base + 3)
        port = n0.kv_base + 4
        got = _batches(ctx, f"tcp://127.0.0.2:{port}", f"tcp://127.0.0.1:{port}", 3)
        assert set(got) == {4}

        base = f"http://127.0.0.1:{n0.http_port}"
        assert not _accepts("127.0.0.2", n0.http_port or 0)  # node 0's HTTP is on its host only
        status, body = _get(f"{base}/server_info")
        assert status == 200
        info = json.loads(body)
        assert (info["nnodes"], info["node_rank"]) == (2, 0)
        assert json.loads(info["kv_events_config"])["endpoint"] == f"tcp://*:{n0.kv_base}"
        if fmt == "sglang-0.5.12":
            assert "kv_events" not in info and info["dp_size"] == 8
        else:  # 0.5.22+: dp_size counts replicas; the publishers are kv_events.dp_size
            assert (info["dp_size"], info["attn_dp_size"], info["kv_events"]["dp_size"]) == (
                1,
                8,
                8,
            )
            assert info["kv_events"]["load_endpoint_port_base"] == n0.load_base
        assert "kv_event_sources" not in info
        ranks = until(  # SGLang's multiprocess metrics: node 0's schedulers only
            lambda: _ranks(_get(f"{base}/metrics")[1], "sglang:token_usage", "dp_rank"), 5,
            "sglang:token_usage of some rank",
        )  # fmt: skip
        assert ranks == {0, 1, 2, 3}


def test_sglang_follower_dummy_server_and_grpc_sources() -> None:
    cfg = SimConfig(format="sglang-0.5.23", dp_size=4, nnodes=2, rate=50, follower_http=True,
                    grpc_port=30001)  # fmt: skip
    with SimulatorGroup(nodes_of(cfg, HOSTS)) as g:
        n0, n1 = g.workers
        stub = f"http://127.0.0.2:{n1.http_port}"
        assert not _accepts("127.0.0.1", n1.http_port or 0)
        assert _get(f"{stub}/health")[0] == 200 and _get(f"{stub}/ping")[0] == 200
        for path in ("/server_info", "/get_server_info", "/kv_event_sources"):
            assert _get(f"{stub}{path}")[0] == 404
        assert _ranks(_get(f"{stub}/metrics")[1], "sglang:num_used_tokens", "dp_rank") == {2, 3}
        info = json.loads(_get(f"http://127.0.0.1:{n0.http_port}/server_info")[1])
        # gRPC mode: node 0's own schedulers, with the endpoints they bound
        assert info["grpc_port"] == 30001
        assert [(s["dp_rank"], s["endpoint"], s["replay_endpoint"]) for s in info["kv_event_sources"]] == [
            (r, f"tcp://127.0.0.1:{n0.kv_base + r}", f"tcp://127.0.0.1:{(n0.replay_base or 0) + r}")
            for r in (0, 1)
        ]  # fmt: skip


def test_vllm_internal_lb_head_serves_every_rank() -> None:
    cfg = SimConfig(format="vllm-0.33", dp_size=4, nnodes=2, rate=100)
    with SimulatorGroup(nodes_of(cfg, HOSTS)) as g:
        head, other = g.workers
        assert other.http_port is None  # --headless
        base = f"http://127.0.0.1:{head.http_port}"
        sources = json.loads(_get(f"{base}/kv_event_sources")[1])
        assert {k: v["endpoint"] for k, v in sources.items()} == {
            str(r): f"tcp://*:{head.kv_base + r}" for r in range(4)
        }

        def every_core() -> str | None:  # the API server hears from every engine core
            text: str = _get(f"{base}/metrics")[1]
            return (
                text if _ranks(text, "vllm:kv_cache_usage_perc", "engine") == {0, 1, 2, 3} else None
            )

        text = until(every_core, 5, "vllm:kv_cache_usage_perc of engines 0-3")
        assert _ranks(text, "vllm:cache_config_info", "engine") == {0, 1, 2, 3}
    # nodes in separate processes: the head cannot read the others' ranks (only its own)
    nodes = nodes_of(cfg, HOSTS)
    head_alone = SimulatedWorker(nodes[0]).start()
    try:
        text = _get(f"http://127.0.0.1:{head_alone.http_port}/metrics")[1]
        assert _ranks(text, "vllm:kv_cache_usage_perc", "engine") == {0, 1}
        sources = json.loads(_get(f"http://127.0.0.1:{head_alone.http_port}/kv_event_sources")[1])
        assert sorted(sources) == ["0", "1", "2", "3"]  # configuration: still every rank
    finally:
        head_alone.stop()


def test_vllm_hybrid_lb_one_api_server_per_node() -> None:
    cfg = SimConfig(format="vllm-0.33", dp_size=4, nnodes=2, rate=100, dp_lb="hybrid")
    with SimulatorGroup(nodes_of(cfg, HOSTS)) as g:
        for w, host, ranks in zip(g.workers, HOSTS, ([0, 1], [2, 3]), strict=True):
            base = f"http://{host}:{w.http_port}"
            other = HOSTS[1] if host == HOSTS[0] else HOSTS[0]
            assert not _accepts(other, w.http_port or 0)
            sources = json.loads(_get(f"{base}/kv_event_sources")[1])
            assert sorted(map(int, sources)) == ranks
            text = _get(f"{base}/metrics")[1]
            assert _ranks(text, "vllm:cache_config_info", "engine") == set(ranks)


def test_vllm_before_031_has_no_kv_event_sources() -> None:
    with SimulatedWorker(SimConfig(format="vllm-0.23", rate=50)) as w:
        base = f"http://127.0.0.1:{w.http_port}"
        assert _get(f"{base}/kv_event_sources")[0] == 404
        assert _get(f"{base}/metrics")[0] == 200
    with SimulatedWorker(SimConfig(format="sglang-0.4", rate=50)) as w:
        base = f"http://127.0.0.1:{w.http_port}"
        assert _get(f"{base}/server_info")[0] == 404  # 0.4.7: only the older name
        assert json.loads(_get(f"{base}/get_server_info")[1])["version"] == "0.4.7"
