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


def _engine(
    nnodes: int | None, dp: int = 8, attn: bool | None = True, node_rank: int | None = None
) -> DiscoveredEngine:
    """What node 0's /server_info says (SGLang, wildcard endpoints, ports from 5557)."""
    srcs = tuple(DiscoveredSource(r, f"tcp://*:{5557 + r}", None, "t", 16) for r in range(dp))
    return DiscoveredEngine(
        "sglang", "http://10.0.0.5:30000/server_info", dp, srcs, 16, dp_attention=attn,
        nnodes=nnodes, node_rank=node_rank,
    )  # fmt: skip


def _node(
    node_rank: int = 0, nnodes: int = 1, host: str = "127.0.0.1", **worker: object
) -> tuple[CollectorConfig, WorkerConfig]:
    o = {
        "collector.node_rank": node_rank, "collector.nnodes": nnodes, "collector.host": host,
        "worker.id": "w", "worker.engine": "sglang", "worker.url": "http://10.0.0.5:30000",
        **{f"worker.{k}": v for k, v in worker.items()},
    }  # fmt: skip
    cfg = load_config(None, o, {})
    return cfg.collector, cfg.workers[0]


def test_an_engine_on_more_nodes_than_configured_leaves_the_others_ranks_alone() -> None:
    node, w = _node()  # the default nnodes = 1 against a 2-node engine
    p = plan_worker(0, w, node, _engine(2))
    assert p.misplaced and p.watched_ranks == (0, 1, 2, 3) and p.elsewhere == (4, 5, 6, 7)
    assert [s.dp_rank for s in p.watched if not s.probe] == [0, 1, 2, 3]
    assert [m.text for m in p.mismatches] == [
        "the engine runs on 2 nodes, [collector] nnodes is 1; set [collector] nnodes = 2 and "
        "run a collector on each node"
    ]
    assert p.notes == tuple(m.text for m in p.mismatches)  # what `kvobserve check` prints
    assert p.info("layout_mismatch").elsewhere == [4, 5, 6, 7]
    # configured right, node 1 of 2: nothing to say
    node1, w1 = _node(1, 2, "10.0.0.6")
    right = plan_worker(0, w1, node1, _engine(2))
    assert (right.mismatches, right.misplaced, right.watched_ranks) == ((), False, (4, 5, 6, 7))


def test_a_setting_that_moves_no_rank_is_a_note_only() -> None:
    # pure-DP SGLang runs every scheduler on node 0: nnodes 1 watches exactly what it runs
    node, w = _node()
    p = plan_worker(0, w, node, _engine(2, attn=False))
    assert [m.setting for m in p.mismatches] == ["nnodes"]
    assert not p.misplaced and p.watched_ranks == tuple(range(8)) and p.elsewhere == ()


def test_node_rank_of_the_engine_served_on_this_node() -> None:
    # node 0's API answers on this node's own host, but the node calls itself node 1
    node, w = _node(1, 2, "10.0.0.5")
    p = plan_worker(0, w, node, _engine(2, node_rank=0))
    assert [m.text for m in p.mismatches] == [
        "http://10.0.0.5:30000/server_info is the engine's node 0 and on this node's host "
        "10.0.0.5, [collector] node_rank is 1; set [collector] node_rank = 0"
    ]
    assert p.misplaced and p.watched_ranks == () and p.elsewhere == (4, 5, 6, 7)
    # the same answer seen from node 1's own host: node 0 is another node, nothing is wrong
    node1, w1 = _node(1, 2, "10.0.0.6")
    other = plan_worker(0, w1, node1, _engine(2, node_rank=0))
    assert other.mismatches == () and other.watched_ranks == (4, 5, 6, 7)


def test_more_ranks_configured_than_the_engine_has() -> None:
    node, w = _node(dp_size=8)
    p = plan_worker(0, w, node, _engine(1, dp=4))  # no endpoint for ranks 4-7: no ConfigError
    assert [m.text for m in p.mismatches] == [
        "the engine has 4 DP ranks, dp_size is 8 in config; set dp_size = 4 or leave it out "
        "(discovery gives it)"
    ]
    assert p.misplaced and p.watched_ranks == (0, 1, 2, 3) and p.elsewhere == (4, 5, 6, 7)
    assert [s.dp_rank for s in p.streams] == [0, 1, 2, 3]


def test_dp_attention_configured_off_for_a_split_engine() -> None:
    node, w = _node(0, 2, dp_attention=False)  # node 0 would watch every rank (pure DP)
    p = plan_worker(0, w, node, _engine(2))
    assert [m.text for m in p.mismatches] == [
        "the engine runs with DP attention, dp_attention is false in config; set dp_attention "
        "= true or leave it out (discovery gives it)"
    ]
    assert p.watched_ranks == (0, 1, 2, 3) and p.elsewhere == (4, 5, 6, 7)
    node1, w1 = _node(dp_attention=False)
    one = plan_worker(0, w1, node1, _engine(1))  # one node: every rank is here anyway
    assert one.mismatches == () and one.watched_ranks == tuple(range(8))


def test_a_vllm_server_listing_part_of_the_ranks_drops_none_it_has() -> None:
    # vLLM says nothing about nodes, and one API server may list only its own ranks: the
    # mismatch is raised, but no advertised rank is dropped on the engine's word
    node, w = _node(dp_size=4, engine="vllm", kv_endpoint="tcp://*:5557")
    srcs = tuple(DiscoveredSource(r, f"tcp://*:{5557 + r}", None, "", None) for r in range(2))
    found = DiscoveredEngine("vllm", "http://10.0.0.5:8000/kv_event_sources", 2, srcs)
    p = plan_worker(0, w, node, found)
    assert [m.setting for m in p.mismatches] == ["dp_size"] and p.misplaced
    assert p.watched_ranks == (0, 1, 2, 3) and p.elsewhere == ()
