"""Simulator configuration: layout rules, validation messages, TOML + flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvobserve.commands.simulate import add_arguments, build_configs
from kvobserve.simulate import FaultConfig, SimConfig, nodes_of


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


def test_dp_attention_splits_ranks_across_nodes_unevenly() -> None:
    cfgs = [SimConfig(dp_size=5, nnodes=2, node_rank=n) for n in (0, 1)]
    assert [c.hosted_ranks() for c in cfgs] == [[0, 1, 2], [3, 4]]
    v = [SimConfig(format="vllm-0.33", dp_size=4, nnodes=2, node_rank=n) for n in (0, 1)]
    assert [c.hosted_ranks() for c in v] == [[0, 1], [2, 3]]


def test_sglang_pure_dp_publishes_from_the_leader_and_old_versions_collide() -> None:
    new = [
        SimConfig(format="sglang-0.5.19", dp_size=3, nnodes=2, node_rank=n, dp_attention=False)
        for n in (0, 1)
    ]
    assert [c.hosted_ranks() for c in new] == [[0, 1, 2], []]
    assert [new[0].port_offset(r) for r in range(3)] == [0, 1, 2]
    old = SimConfig(format="sglang-0.5.12", dp_size=3, dp_attention=False)
    assert [old.port_offset(r) for r in range(3)] == [0, 0, 0]


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"dp_size": 0}, "dp_size: 0"),
        ({"nnodes": 2, "node_rank": 2}, "node_rank: 2"),
        ({"format": "vllm-0.10", "load_port": 0}, "load_port"),
        (
            {"format": "vllm-0.33", "kv_metrics_endpoint": "tcp://127.0.0.1:1"},
            "kv_metrics_endpoint",
        ),
        ({"faults": FaultConfig(drop_rate=2.0)}, "faults.drop_rate: 2.0"),
        ({"faults": FaultConfig(mirror=((0, 5),))}, "faults.mirror: rank 5"),
        ({"kv_port": 70000}, "kv_port: 70000"),
        ({"format": "vllm-0.33", "grpc_port": 30001}, "grpc_port: format vllm-0.33"),
        ({"dp_lb": "external"}, "dp_lb: 'external'"),
        ({"nnodes": 2, "node_hosts": ("127.0.0.1",)}, "node_hosts: 1 hosts for nnodes 2"),
        ({"kv_connect": "ipc:///tmp/kv"}, "kv_connect: 'ipc:///tmp/kv' is not tcp://host:port"),
        ({"kv_connect": "tcp://127.0.0.1:5557", "kv_port": 5557}, "kv_port: 5557 with kv_connect"),
    ],
)
def test_validation_names_field_and_value(kw: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        SimConfig(**kw).validate()  # type: ignore[arg-type]


def test_toml_workers_with_flags_on_top(tmp_path: Path) -> None:
    f = tmp_path / "sim.toml"
    f.write_text(
        '[[worker]]\nid = "a"\nformat = "vllm-0.23"\ndp_size = 4\n'
        "[worker.faults]\ndrop_seqs = [3, 4]\nmirror = [[0, 1]]\n"
        '[[worker]]\nformat = "sglang-0.4"\n'
    )
    a, b = build_configs(_args("-c", str(f), "--rate", "7", "--stray-publisher"))
    assert (a.worker_id, a.format, a.dp_size, a.rate) == ("a", "vllm-0.23", 4, 7.0)
    assert a.faults.drop_seqs == {3, 4} and a.faults.mirror == ((0, 1),)
    assert a.faults.stray_publisher and b.faults.stray_publisher
    assert (b.worker_id, b.format, b.rate) == ("sim-1", "sglang-0.4", 7.0)


def test_toml_unknown_key_is_named(tmp_path: Path) -> None:
    f = tmp_path / "sim.toml"
    f.write_text('[[worker]]\nformat = "vllm-0.23"\nrat = 5\n')
    with pytest.raises(ValueError, match=r"worker\.rat"):
        build_configs(_args("-c", str(f)))
    f.write_text("[[worker]]\n[worker.faults]\ndrop = [1]\n")
    with pytest.raises(ValueError, match=r"faults\.drop"):
        build_configs(_args("-c", str(f)))


def test_bad_fault_flag_is_named() -> None:
    with pytest.raises(ValueError, match="--mirror"):
        build_configs(_args("--mirror", "0-1"))


def test_all_nodes_share_port_bases_and_only_the_leader_serves_http() -> None:
    nodes = nodes_of(SimConfig(dp_size=4, nnodes=2))
    assert [n.node_rank for n in nodes] == [0, 1]
    assert nodes[0].kv_port == nodes[1].kv_port != 0
    assert nodes[0].replay_port == nodes[1].replay_port != 0
    assert (nodes[0].http_port, nodes[1].http_port) == (0, None)


def test_nodes_of_puts_each_node_on_its_host_and_ports_free_on_all() -> None:
    nodes = nodes_of(SimConfig(dp_size=4, nnodes=2, load_port=0), hosts=["127.0.0.1", "127.0.0.2"])
    assert [n.host for n in nodes] == ["127.0.0.1", "127.0.0.2"]
    bases = [nodes[0].kv_port, nodes[0].replay_port, nodes[0].load_port]
    assert all(b for b in bases) and len({b for b in bases}) == 3
    assert all(abs(a - b) >= 5 for a in bases for b in bases if a != b)  # ranges do not overlap
    assert all((n.kv_port, n.replay_port, n.load_port) == tuple(bases) for n in nodes)
    with pytest.raises(ValueError, match="node_hosts: 3 hosts for nnodes 2"):
        nodes_of(SimConfig(nnodes=2), hosts=["127.0.0.1", "127.0.0.2", "127.0.0.3"])


def test_node_hosts_and_multi_node_flags() -> None:
    cfgs = build_configs(
        _args("--all-nodes", "--nnodes", "2", "--node-hosts", "127.0.0.1,127.0.0.2",
              "--follower-http", "--grpc-port", "30001")
    )  # fmt: skip
    assert [(c.node_rank, c.host, c.http_role) for c in cfgs] == [
        (0, "127.0.0.1", "api"),
        (1, "127.0.0.2", "stub"),
    ]
    assert cfgs[0].grpc_port == 30001
    (v,) = build_configs(_args("--format", "vllm-0.33", "--dp-lb", "hybrid"))
    assert v.dp_lb == "hybrid"
