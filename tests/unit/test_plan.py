"""Plans: a wildcard host is the node that owns the rank; who reads which scheduler source."""

from __future__ import annotations

import pytest

from kvobserve.analysis.layout import on_node
from kvobserve.config import CollectorConfig, WorkerConfig, load_config
from kvobserve.sources.discovery_parse import DiscoveredEngine, DiscoveredSource
from kvobserve.sources.plan import node_url, plan_worker


@pytest.mark.parametrize(
    ("endpoint", "host", "want"),
    [
        ("tcp://*:5557", "10.0.0.6", "tcp://10.0.0.6:5557"),
        ("tcp://0.0.0.0:5557", "10.0.0.6", "tcp://10.0.0.6:5557"),
        ("tcp://[::]:5557", "fd00::6", "tcp://[fd00::6]:5557"),
        ("tcp://:5557", "127.0.0.2", "tcp://127.0.0.2:5557"),
        ("tcp://10.0.0.5:5557", "10.0.0.6", "tcp://10.0.0.5:5557"),  # explicit: as given
        ("ipc:///tmp/kv", "10.0.0.6", "ipc:///tmp/kv"),
    ],
)
def test_on_node(endpoint: str, host: str, want: str) -> None:
    assert on_node(endpoint, host) == want


def test_node_url() -> None:
    assert node_url("http://0.0.0.0:30000/metrics", "10.0.0.6") == "http://10.0.0.6:30000/metrics"
    assert node_url("http://*:30000/metrics", "::1") == "http://[::1]:30000/metrics"
    assert node_url("http://10.0.0.5:30000/metrics", "10.0.0.6") is None


def _cfg(node_rank: int, **worker: object) -> tuple[CollectorConfig, WorkerConfig]:
    o = {
        "collector.node_rank": node_rank, "collector.nnodes": 2, "collector.host": f"10.0.0.{5 + node_rank}",
        "worker.id": "w", "worker.engine": "sglang", **{f"worker.{k}": v for k, v in worker.items()},
    }  # fmt: skip
    cfg = load_config(None, o, {})
    return cfg.collector, cfg.workers[0]


def test_one_config_each_node_its_own_ranks_and_sources() -> None:
    shared = {
        "kv_endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5657", "dp_size": 8,
        "dp_attention": True, "load_endpoint": "tcp://*:5573", "fpm_endpoint": "tcp://*:7000",
        "metrics_url": "http://10.0.0.5:30000/metrics", "kv_metrics_endpoint": "tcp://*:9000",
    }  # fmt: skip
    for k in (0, 1):
        node, w = _cfg(k, **shared)
        p = plan_worker(0, w, node, None)
        host = f"10.0.0.{5 + k}"
        mine = range(4 * k, 4 * k + 4)
        assert [(s.dp_rank, s.endpoint, s.replay_endpoint) for s in p.watched if not s.probe] == [
            (r, f"tcp://{host}:{5557 + r}", f"tcp://{host}:{5657 + r}") for r in mine
        ]
        others = [s.endpoint for s in p.streams if s.dp_rank not in mine]
        assert all(e.startswith("tcp://*:") for e in others)
        assert p.owners == (0, 0, 0, 0, 1, 1, 1, 1)
        got = [(s.source, s.scope, e) for s in p.scheduler for e in s.endpoints]
        per_rank = [("load", "rank", f"tcp://{host}:{5573 + r}") for r in mine] + [
            ("fpm", "rank", f"tcp://{host}:{7000 + r}") for r in mine
        ]
        leader = [
            ("metrics", "leader", shared["metrics_url"]),
            ("kv_metrics", "leader", "tcp://*:9000"),
        ]
        assert sorted(got) == sorted(per_rank + (leader if k == 0 else []))
        assert [s.endpoint for s in p.probes] == ([f"tcp://{host}:5565"] if k == 1 else [])
        assert p.notes == ()


def test_wildcard_metrics_url_is_every_nodes_own_engine() -> None:
    node, w = _cfg(1, kv_endpoint="tcp://*:5557", dp_size=2, dp_attention=True,
                   metrics_url="http://0.0.0.0:30000/metrics")  # fmt: skip
    p = plan_worker(0, w, node, None)
    assert [(s.source, s.scope, s.endpoints) for s in p.scheduler] == [
        ("metrics", "node", ("http://10.0.0.6:30000/metrics",))
    ]


def test_explicit_host_on_a_split_worker_is_noted() -> None:
    node, w = _cfg(1, kv_endpoint="tcp://10.0.0.5:5557", dp_size=8, dp_attention=True)
    p = plan_worker(0, w, node, None)
    assert p.watched[0].endpoint == "tcp://10.0.0.5:5561"  # used as given
    assert p.notes == (
        "kv_endpoint tcp://10.0.0.5:5557: every node connects to 10.0.0.5; a wildcard host "
        "(tcp://*:PORT) means each rank's own node",
    )


def test_discovered_attention_dp_splits_the_ranks() -> None:
    node, w = _cfg(1, url="http://10.0.0.5:30000")
    found = DiscoveredEngine(
        "sglang", "http://10.0.0.5:30000/server_info", 4,
        tuple(DiscoveredSource(r, f"tcp://*:{5557 + r}", None, "t", 16) for r in range(4)),
        16, "tcp://*:5561", "load", "0.5.23", True, 2,
    )  # fmt: skip
    p = plan_worker(0, w, node, found)
    assert p.dp_attention and p.watched_ranks == (2, 3)
    assert [s.endpoint for s in p.watched] == ["tcp://10.0.0.6:5559", "tcp://10.0.0.6:5560"]
    assert [e for s in p.scheduler for e in s.endpoints] == [
        "tcp://10.0.0.6:5563",
        "tcp://10.0.0.6:5564",
    ]
    pure = DiscoveredEngine(found.engine, found.url, 4, found.sources, dp_attention=False)
    assert plan_worker(0, w, node, pure).watched_ranks == ()
