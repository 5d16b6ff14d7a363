"""Acceptance: one worker over two nodes, every rank watched on its own node, usage for every rank.

Five simulated deployments, each over node 0 (127.0.0.1) and node 1 (127.0.0.2), every publisher
bound on its own node's address only (connecting to the other node gets nothing): SGLang 0.5.23
(the `kv_events` block, load PUB), 0.5.22 (attention DP as `dp_size 1, attn_dp_size 8`, gRPC-mode
`kv_event_sources`, load PUB), 0.5.12 (only the raw `kv_events_config`; usage from each node's
/metrics), vLLM 0.33 with internal load balancing (node 0's API server lists every rank and
serves every rank's /metrics) and with hybrid load balancing (one API server per node, each
listing its own ranks: both URLs given). Two `kvobserve collect` processes read ONE config file
holding only node 0's URL per worker (vLLM hybrid: both API servers) and no endpoint; each gets
its node_rank and host from the environment (node 0) or flags (node 1). One `kvobserve
aggregate` serves them over a real nats-server; `kvobserve check` on node 1 is asserted too.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvobserve.simulate import SimConfig, SimulatorGroup, nodes_of
from kvobserve.simulate.ports import free_port, free_port_range
from tests.integration.conftest import NatsServer
from tests.integration.fleet_helpers import (
    ROOT,
    Procs,
    Scrape,
    clean_env,
    fetch,
    scrape,
    write_toml,
)
from tests.polling import until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

HOSTS = ("127.0.0.1", "127.0.0.2")
MAX_BATCHES = 300
STREAM_KEYS = ("worker_id", "node_rank", "dp_rank")
# The engines publish 8 s after they start, for 6 s: the collectors connect before or while they
# publish (a collector joining mid-stream replays from seq 0), never after the last batch.
BASE = SimConfig(
    dp_size=8, nnodes=2, topic="kv-events", rate=50.0, max_batches=MAX_BATCHES, prompts=40,
    start_delay_s=8.0, capacity_tokens=8192, seed=3,
)  # fmt: skip


def _deployments() -> dict[str, SimConfig]:
    same_port = free_port_range(HOSTS, 1)  # a node's HTTP port: the same --port on every node
    hybrid_port = free_port_range(HOSTS, 1, avoid=(same_port,))
    vllm = dataclasses.replace(BASE, format="vllm-0.33", dp_size=4, topic="")
    return {
        "sg23": dataclasses.replace(BASE, format="sglang-0.5.23", load_port=0),
        "sg22": dataclasses.replace(BASE, format="sglang-0.5.22", load_port=0, grpc_port=31001),
        "sg12": dataclasses.replace(
            BASE, format="sglang-0.5.12", follower_http=True, http_port=same_port
        ),
        "vl-int": vllm,
        "vl-hyb": dataclasses.replace(vllm, dp_lb="hybrid", http_port=hybrid_port),
    }


@dataclasses.dataclass
class Fleet:
    """The simulated deployments, by worker id."""

    groups: dict[str, SimulatorGroup]

    def node(self, wid: str, k: int) -> Any:
        return self.groups[wid].workers[k]

    def owner(self, wid: str, rank: int) -> int:
        return next(
            w.cfg.node_rank for w in self.groups[wid].workers if rank in w.cfg.hosted_ranks()
        )

    def ranks(self) -> Iterator[tuple[str, int, int, dict[str, Any]]]:
        """(worker_id, node_rank, dp_rank, the rank's only publisher instance)."""
        for wid, g in self.groups.items():
            for w in g.workers:
                t = w.truth()
                for rank, st in t["ranks"].items():
                    (inst,) = st["instances"]
                    yield wid, w.cfg.node_rank, int(rank), inst


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    groups: dict[str, SimulatorGroup] = {}
    try:
        for wid, cfg in _deployments().items():
            nodes = nodes_of(dataclasses.replace(cfg, worker_id=wid), HOSTS)
            groups[wid] = SimulatorGroup(nodes).start()
        yield Fleet(groups)
    finally:
        for g in groups.values():
            g.stop()


def _shared_config(path: Path, f: Fleet, nats: str) -> Path:
    """The one file every node reads: node 0's URL per worker, no endpoint, no node address."""

    def url(wid: str, k: int = 0) -> str:
        return f"http://{HOSTS[k]}:{f.node(wid, k).http_port}"

    workers: list[dict[str, Any]] = [
        {"id": "sg23", "engine": "sglang", "url": url("sg23")},
        {"id": "sg22", "engine": "sglang", "url": url("sg22")},
        {
            "id": "sg12",
            "engine": "sglang",
            "url": url("sg12"),
            # each node's own engine: node 0's API server, node 1's dummy server
            "metrics_url": f"http://*:{f.node('sg12', 0).http_port}/metrics",
        },
        {
            "id": "vl-int",
            "engine": "vllm",
            "url": url("vl-int"),
            "metrics_url": url("vl-int") + "/metrics",
        },
        {
            "id": "vl-hyb",
            "engine": "vllm",
            "url": [url("vl-hyb", 0), url("vl-hyb", 1)],
            "metrics_url": f"http://*:{f.node('vl-hyb', 0).http_port}/metrics",
        },
    ]
    doc = {
        "cluster": "mn",
        "collector": {"nnodes": 2, "interval_s": 0.5},
        "worker": workers,
        "nats": {"url": nats},
    }
    return write_toml(path, doc)


def _check(cfg: Path, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "kvobserve", "check", "-c", str(cfg), *args],
        capture_output=True, text=True, timeout=60, env=clean_env(), cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_check_on_node_1_prints_the_addresses_it_connects_to(fleet: Fleet, tmp_path: Path) -> None:
    cfg = _shared_config(tmp_path / "kvobserve.toml", fleet, "nats://127.0.0.1:4222")
    node1 = ("--node-rank", "1", "--collector-host", "127.0.0.2", "--collector-id", "node-1")
    n0 = fleet.node("sg23", 0)
    kv, replay, load = n0.kv_base, n0.replay_base, n0.load_base
    text = _check(cfg, *node1)
    block = text.split("worker sg23 ")[1].split("\nworker ")[0]
    assert "(sglang, dp_size 8, DP attention, not leader)" in block
    for r in range(4, 8):  # this node's ranks: at its own address, replay too
        line = f" *{r:<8} {1:<5} {f'tcp://127.0.0.2:{kv + r}':<32} tcp://127.0.0.2:{replay + r}"
        assert line in block, block
    assert f"  {'0-3':<8} {0:<5} (node 0's collector connects to these)" in block
    assert "127.0.0.1" not in block.split("discovered from")[1].split("\n", 1)[1], block
    assert f"  probe endpoints: tcp://127.0.0.2:{kv + 8}" in block
    for r in range(4, 8):
        assert f"    {'load':<10} {f'tcp://127.0.0.2:{load + r}':<40} (rank {r})" in block

    doc = json.loads(_check(cfg, *node1, "--json"))
    assert doc["collector"] == {"id": "node-1", "node_rank": 1, "nnodes": 2, "host": "127.0.0.2"}
    plans = {p["worker_id"]: p for p in doc["workers"]}
    for wid, p in plans.items():
        n = fleet.node(wid, 0)
        size = n.cfg.dp_size
        mine = [s for s in p["streams"] if s["watched"]]
        assert [s["dp_rank"] for s in mine] == list(range(size // 2, size))
        assert [s["endpoint"] for s in mine] == [f"tcp://127.0.0.2:{n.kv_base + r}" for r in range(size // 2, size)]  # fmt: skip
        others = [s for s in p["streams"] if not s["watched"]]
        assert {s["node_rank"] for s in others} == {0}
        assert all(s["endpoint"].startswith("tcp://*:") for s in others), "no address made up"
    assert plans["sg12"]["scheduler_sources"] == [
        {"source": "metrics", "scope": "node", "dp_rank": None,
         "endpoint": f"http://127.0.0.2:{fleet.node('sg12', 0).http_port}/metrics"},
    ]  # fmt: skip
    assert plans["vl-int"]["scheduler_sources"] == []  # the leader (node 0) scrapes the API server
    assert plans["vl-hyb"]["block_size"] == BASE.page_size


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.stop_all()


def _want(fleet: Fleet) -> dict[tuple[str, str, str], dict[str, Any]]:
    return {(w, str(n), str(r)): inst for w, n, r, inst in fleet.ranks()}


def test_two_nodes_one_config_every_rank_on_its_node_with_usage(
    fleet: Fleet, nats_server: NatsServer, procs: Procs, tmp_path: Path
) -> None:
    cfg = _shared_config(tmp_path / "kvobserve.toml", fleet, nats_server.url)
    agg_port, p0, p1 = free_port(), free_port(), free_port()
    agg = f"http://127.0.0.1:{agg_port}"
    procs.kvobserve(
        "aggregate", "aggregate", "--nats", nats_server.url, "--cluster", "mn",
        "--listen", f"127.0.0.1:{agg_port}",
    )  # fmt: skip
    env0 = clean_env(
        KVOBSERVE_COLLECTOR_ID="node-0", KVOBSERVE_COLLECTOR_NODE_RANK="0",
        KVOBSERVE_COLLECTOR_HOST="127.0.0.1",
    )  # fmt: skip
    procs.kvobserve("node-0", "collect", "-c", str(cfg), "--listen", f"127.0.0.1:{p0}", env=env0)
    procs.kvobserve(
        "node-1", "collect", "-c", str(cfg), "--listen", f"127.0.0.1:{p1}", "--collector-id",
        "node-1", "--node-rank", "1", "--collector-host", "127.0.0.2",
    )  # fmt: skip
    keys = set(_want(fleet))
    assert len(keys) == 32

    def finished() -> Scrape | None:
        s = scrape(agg)
        if s is None:
            return None
        batches = s.by("kvobserve_kv_event_batches_total", STREAM_KEYS)
        usage = s.by("kvobserve_scheduler_token_usage_ratio", STREAM_KEYS)
        if set(batches) != keys or any(v != MAX_BATCHES for v in batches.values()):
            return None
        return s if set(usage) == keys else None

    def describe() -> object:
        return {pid: procs.log(pid)[-2000:] for pid in [p.pid for p, _ in procs.started]}

    s = until(finished, 60, "every rank's batches and usage at the aggregator", describe)
    want = _want(fleet)  # every engine published all its batches: the truth no longer moves
    assert all(inst["batches"] == MAX_BATCHES for inst in want.values())
    info = s.by("kvobserve_stream_info", (*STREAM_KEYS, "endpoint", "collector"))
    for w, n, r, endpoint, collector in info:
        node = int(n)
        assert node == fleet.owner(w, int(r)), "labelled with the node that owns the rank"
        assert collector == f"node-{node}"
        port = fleet.node(w, 0).kv_base + int(r)
        assert endpoint == f"tcp://{HOSTS[node]}:{port}", "watched at its own node's address"
    assert len(info) == 32, "every rank watched once"
    assert set(s.by("kvobserve_dp_rank_owners", ("worker_id", "dp_rank")).values()) == {1.0}

    blocks = s.by("kvobserve_kv_blocks", (*STREAM_KEYS, "medium"))
    truth_blocks = {
        (*k, medium): float(len(hashes))
        for k, inst in want.items()
        for medium, hashes in inst["resident"].items()
    }
    assert blocks == truth_blocks
    assert all(v > 0 for v in truth_blocks.values())

    def usage_of(s: Scrape) -> dict[str, dict[tuple[str, ...], float]]:
        names = ("kv_capacity_tokens", "kv_cache_usage_ratio", "scheduler_token_usage_ratio")
        return {n: s.by(f"kvobserve_{n}", STREAM_KEYS) for n in names}

    truth = {  # the engines are done: their state no longer moves
        "kv_capacity_tokens": dict.fromkeys(want, float(BASE.capacity_tokens)),
        "kv_cache_usage_ratio": {
            k: sum(inst["resident_tokens"].values()) / BASE.capacity_tokens
            for k, inst in want.items()
        },
        "scheduler_token_usage_ratio": {
            k: inst["held_tokens"] / BASE.capacity_tokens for k, inst in want.items()
        },
    }

    def converged() -> bool:  # a scrape or a LoadStat from before the last batch is replaced
        got = scrape(agg)
        return got is not None and usage_of(got) == truth

    until(converged, 15, "capacity and usage == the engines'", lambda: (truth, scrape(agg)))
    assert all(0 < v < 1 for v in truth["scheduler_token_usage_ratio"].values())

    streams = json.loads(fetch(f"{agg}/api/v1/streams") or "[]")
    sources = {(x["worker_id"], x["dp_rank"]): x["scheduler_source"] for x in streams}
    # every node reads its own ranks' load PUB; the leader also scrapes url + /metrics, which
    # node 0's engine serves for its own ranks only
    assert {k: v for k, v in sources.items() if k[0] == "sg23"} == {
        ("sg23", r): "load+metrics" if r < 4 else "load" for r in range(8)
    }
    assert {v for k, v in sources.items() if k[0] in ("sg12", "vl-int", "vl-hyb")} == {"metrics"}
