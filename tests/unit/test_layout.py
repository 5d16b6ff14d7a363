"""DP-rank ownership per node and the engines' per-rank port rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvobserve.analysis.layout import (
    offset_endpoint,
    owned_ranks,
    parse_version,
    publisher_rank,
    watched_ranks,
)

CAPTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engine-captures"


def test_dp_size_6_over_4_nodes_is_owned_exactly_once_2_2_1_1() -> None:
    parts = [owned_ranks(n, 4, 6) for n in range(4)]
    assert [list(p) for p in parts] == [[0, 1], [2, 3], [4], [5]]


def test_fewer_ranks_than_nodes_leaves_the_last_nodes_empty() -> None:
    assert [list(owned_ranks(n, 4, 2)) for n in range(4)] == [[0], [1], [], []]


@given(st.integers(1, 16), st.integers(1, 64))
def test_every_rank_owned_exactly_once(nnodes: int, dp_size: int) -> None:
    owned = [r for n in range(nnodes) for r in owned_ranks(n, nnodes, dp_size)]
    assert owned == list(range(dp_size))  # contiguous, in node order, no rank twice or missing
    sizes = [len(owned_ranks(n, nnodes, dp_size)) for n in range(nnodes)]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((4, 4, 8), "node_rank=4"),
        ((-1, 4, 8), "node_rank=-1"),
        ((0, 0, 8), "nnodes=0"),
        ((0, 2, 0), "dp_size=0"),
        ((0, 2, True), "dp_size=True"),
    ],
)
def test_bad_layout_names_the_field_and_value(args: tuple[int, int, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        owned_ranks(*args)


def test_pure_dp_sglang_is_watched_by_node_0_only() -> None:
    assert watched_ranks("sglang", False, 0, 2, 4) == range(4)
    assert watched_ranks("sglang", False, 1, 2, 4) == range(0)
    assert watched_ranks("sglang", True, 1, 2, 4) == range(2, 4)
    assert watched_ranks("vllm", False, 1, 2, 5) == range(3, 5)
    with pytest.raises(ValueError, match="engine='trt'"):
        watched_ranks("trt", True, 0, 1, 1)
    with pytest.raises(ValueError, match="node_rank=2"):
        watched_ranks("sglang", False, 2, 2, 4)


@pytest.mark.parametrize(
    ("endpoint", "rank", "engine", "want"),
    [
        ("tcp://*:5557", 0, "sglang", "tcp://*:5557"),
        ("tcp://*:5557", 3, "sglang", "tcp://*:5560"),
        ("tcp://10.0.0.5:5557", 1, "vllm", "tcp://10.0.0.5:5558"),
        ("tcp://[::1]:5557", 2, "sglang", "tcp://[::1]:5559"),
        ("tcp://[fe80::1%eth0]:6000", 1, "vllm", "tcp://[fe80::1%eth0]:6001"),
        ("inproc://kv", 2, "sglang", "inproc://kv_dp2"),
        ("", 5, "sglang", ""),
        ("tcp://*:0", 4, "vllm", "tcp://*:0"),  # vLLM: an OS-chosen port stays OS-chosen
        ("tcp://*:0", 4, "sglang", "tcp://*:4"),
        ("ipc:///tmp/kv", 0, "vllm", "ipc:///tmp/kv"),  # rank 0 is never rewritten
    ],
)
def test_offset_endpoint(endpoint: str, rank: int, engine: str, want: str) -> None:
    assert offset_endpoint(endpoint, rank, engine) == want


@pytest.mark.parametrize(
    "endpoint", ["ipc:///tmp/kv", "udp://h:1", "tcp://[::1]", "tcp://host", "tcp://h:65535"]
)
def test_offset_endpoint_rejects_what_the_engines_reject(endpoint: str) -> None:
    with pytest.raises(ValueError, match=r"endpoint='" + endpoint.replace("[", r"\[")):
        offset_endpoint(endpoint, 1, "sglang")


def test_offset_endpoint_matches_the_capture_ports() -> None:
    for meta_path in sorted(CAPTURES.glob("*/meta.json")):
        meta = json.loads(meta_path.read_text())
        engine = meta["engine"]
        for rank, ports in meta["ports"].items():
            pub = offset_endpoint(meta["endpoint"], int(rank), engine)
            replay = offset_endpoint(meta["replay_endpoint"], int(rank), engine)
            assert pub.endswith(f":{ports['pub']}"), meta_path
            assert replay.endswith(f":{ports['replay']}"), meta_path


def test_publisher_rank_before_and_after_sglang_0_5_16() -> None:
    # pure DP, scheduler of dp_rank 3: old versions collide on rank 0 (attn_dp_rank)
    assert publisher_rank("sglang", (0, 5, 14), False, 0, 3) == 0
    assert publisher_rank("sglang", (0, 5, 16), False, 0, 3) == 3
    assert publisher_rank("sglang", (0, 5, 23), False, 0, None) == 0
    # DP attention: attn_dp_rank in every version
    assert publisher_rank("sglang", (0, 4, 7), True, 2, None) == 2
    assert publisher_rank("sglang", (0, 5, 23), True, 2, 0) == 2
    assert publisher_rank("vllm", (0, 33, 0), False, 0, 5) == 5


def test_parse_version() -> None:
    assert parse_version("0.5.16") == (0, 5, 16)
    assert parse_version("v0.5.16.post1") == (0, 5, 16)
    assert parse_version("0.10.0rc2") == (0, 10, 0)
    with pytest.raises(ValueError, match="version='dev'"):
        parse_version("dev")
