"""SGLang /server_info and vLLM /kv_event_sources exactly as each engine version serves them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvobserve.simulate import SimConfig, SimulatedWorker, nodes_of
from kvobserve.simulate.discovery import kv_event_sources, server_info


def _worker(fmt: str, **kw: Any) -> SimulatedWorker:
    """An unstarted worker with fixed ports: discovery is a function of its configuration."""
    kw.setdefault("dp_size", 8)
    kw.setdefault("replay_port", 5657)
    return SimulatedWorker(SimConfig(format=fmt, kv_port=5557, topic="kv-events", **kw))


def test_sglang_047_and_0512_have_only_the_raw_config_string() -> None:
    for fmt, version in (("sglang-0.4", "0.4.7"), ("sglang-0.5.12", "0.5.12")):
        info = server_info(_worker(fmt, nnodes=2))
        assert "kv_events" not in info and "attn_dp_size" not in info
        assert "kv_event_sources" not in info and "launch_command" not in info
        assert (info["version"], info["dp_size"], info["enable_dp_attention"]) == (version, 8, True)
        assert (info["nnodes"], info["node_rank"], info["page_size"]) == (2, 0, 16)
        raw = json.loads(info["kv_events_config"])  # a JSON string, as launched
        assert raw["endpoint"] == "tcp://*:5557" and raw["replay_endpoint"] == "tcp://*:5657"
        assert (raw["publisher"], raw["topic"]) == ("zmq", "kv-events")


def test_sglang_0519_kv_events_block_without_replay_base() -> None:
    info = server_info(_worker("sglang-0.5.19", load_port=5700))
    assert (info["dp_size"], info["enable_dp_attention"]) == (8, True)
    assert "attn_dp_size" not in info and "launch_command" not in info
    assert info["kv_events"] == {
        "publisher": "zmq",
        "endpoint_host": "*",
        "endpoint_port_base": 5557,
        "topic": "kv-events",
        "block_size": 16,
        "dp_size": 8,
        "load_endpoint_port_base": 5700,
        "load_topic": "load",
    }
    assert "load_endpoint_port_base" not in server_info(_worker("sglang-0.5.19"))["kv_events"]


@pytest.mark.parametrize("fmt", ["sglang-0.5.22", "sglang-0.5.23"])
def test_sglang_022_attention_dp_reports_dp_size_1(fmt: str) -> None:
    info = server_info(_worker(fmt, nnodes=2))
    # --dp-size 8 --enable-dp-attention resolves to attn_dp_size 8, dp_size 1
    assert (info["dp_size"], info["attn_dp_size"], info["enable_dp_attention"]) == (1, 8, True)
    kv = info["kv_events"]
    assert (kv["dp_size"], kv["endpoint_host"], kv["replay_endpoint_port_base"]) == (8, "*", 5657)
    assert "load_endpoint_port_base" not in kv  # no load publisher asked for
    assert "kv_event_sources" not in info and info["grpc_port"] is None  # a normal launch
    assert info["version"] == fmt.removeprefix("sglang-")
    assert "--enable-dp-attention" in info["launch_command"]
    assert "--kv-events-config" in info["launch_command"] and info["frontend"] == "python"
    pure = server_info(_worker(fmt, dp_attention=False))
    assert (pure["dp_size"], pure["attn_dp_size"], pure["enable_dp_attention"]) == (8, 1, False)
    assert pure["kv_events"]["dp_size"] == 8


def test_sglang_0522_replay_base_only_with_a_replay_endpoint() -> None:
    info = server_info(_worker("sglang-0.5.22", replay_port=None))
    assert "replay_endpoint_port_base" not in info["kv_events"]
    assert "replay_endpoint" not in json.loads(info["kv_events_config"])


@pytest.mark.parametrize("lb", ["internal", "hybrid"])
def test_vllm_kv_event_sources_keep_the_wildcard_and_list_managed_ranks(lb: str) -> None:
    cfg = SimConfig(format="vllm-0.33", dp_size=5, nnodes=2, kv_port=5557, replay_port=5657,
                    dp_lb=lb)  # fmt: skip
    head, second = (SimulatedWorker(c) for c in nodes_of(cfg, ("127.0.0.1", "127.0.0.2")))
    on_head = kv_event_sources(head)
    assert sorted(on_head, key=int) == (["0", "1", "2", "3", "4"] if lb == "internal" else
                                        ["0", "1", "2"])  # fmt: skip
    assert on_head["2"]["endpoint"] == "tcp://*:5559"
    assert on_head["2"]["replay_endpoint"] == "tcp://*:5659"
    assert "block_size" not in on_head["2"] and on_head["2"]["topic"] == ""
    assert (second.cfg.http_port is not None) == (lb == "hybrid")
    if lb == "hybrid":
        assert sorted(kv_event_sources(second)) == ["3", "4"]


def test_http_roles_per_engine_and_node() -> None:
    sg = nodes_of(SimConfig(format="sglang-0.5.23", dp_size=4, nnodes=2))
    assert [c.http_role for c in sg] == ["api", None]
    sg = nodes_of(SimConfig(format="sglang-0.5.23", dp_size=4, nnodes=2, follower_http=True))
    assert [c.http_role for c in sg] == ["api", "stub"]
    assert SimConfig(format="vllm-0.33", nnodes=2, node_rank=1).http_role is None  # headless
    assert SimConfig(format="vllm-0.33", nnodes=2, node_rank=1, dp_lb="hybrid").http_role == "api"
    assert SimConfig(format="sglang-0.5.12", nnodes=2, node_rank=1).http_role == "stub"
