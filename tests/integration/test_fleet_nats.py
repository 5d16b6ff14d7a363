"""Acceptance: a 3-node fleet over a real nats-server on one Prometheus endpoint.

Three `kvobserve collect` processes (node_rank 0, 1, 2) watch a simulated SGLang DP-attention
worker (dp_size 8: ranks 0-2, 3-5, 6-7) and a vLLM worker (dp_size 4: the uneven split 0-1, 2, 3);
one `kvobserve aggregate` process serves the fleet. A fourth collector claims node_rank 2 again,
is stopped by SIGTERM, and the nats-server restarts while the engines publish.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvobserve.simulate import SimConfig, SimulatedWorker, nodes_of
from kvobserve.simulate.ports import free_port
from tests.integration.conftest import NatsServer
from tests.integration.fleet_helpers import Procs, Scrape, scrape, worker_tables, write_toml
from tests.polling import until

pytestmark = pytest.mark.integration

INTERVAL = 0.5
RATE = 40.0  # batches/s per rank: the engines still publish when NATS restarts
MAX_BATCHES = 300
CLUSTER = "fleet"
SGLANG = SimConfig(
    worker_id="sglang-dp8", format="sglang-0.5.23", dp_size=8, nnodes=3, dp_attention=True,
    topic="kv-events", rate=RATE, max_batches=MAX_BATCHES, start_delay_s=1.0, http_port=None,
    prompts=40, seed=1,
)  # fmt: skip
VLLM = dataclasses.replace(SGLANG, worker_id="vllm-dp4", format="vllm-0.33", dp_size=4, topic="")
# (worker_id, dp_rank) -> the node_rank whose collector owns it
OWNER = {("sglang-dp8", r): r // 3 for r in range(8)} | {("vllm-dp4", r): (0, 0, 1, 2)[r] for r in range(4)}  # fmt: skip
STREAM_KEYS = ("worker_id", "node_rank", "dp_rank")


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.stop_all()


@dataclasses.dataclass
class Engines:
    """Per worker, the node configs (ports resolved once); the engines started from them."""

    plan: list[list[SimConfig]]
    started: list[SimulatedWorker] = dataclasses.field(default_factory=list)

    def start(self) -> None:
        """Start every node of every worker."""
        for nodes in self.plan:
            for cfg in nodes:
                self.started.append(SimulatedWorker(cfg).start())

    def truth(self) -> Iterator[tuple[str, str, str, dict[str, Any]]]:
        """(worker_id, node_rank label, dp_rank label, the rank's only publisher instance)."""
        for sim in self.started:
            t = sim.truth()
            for rank, st in t["ranks"].items():
                (inst,) = st["instances"]
                yield t["worker_id"], str(OWNER[(t["worker_id"], int(rank))]), rank, inst


@pytest.fixture
def engines() -> Iterator[Engines]:
    e = Engines([nodes_of(SGLANG), nodes_of(VLLM)])
    yield e
    for sim in e.started:
        sim.stop()


def _collector_toml(
    path: Path, cid: str, node_rank: int, listen: str, nats: str, plan: list[list[SimConfig]]
) -> Path:
    workers = worker_tables(plan)
    doc = {
        "cluster": CLUSTER,
        "collector": {
            "id": cid,
            "node_rank": node_rank,
            "nnodes": 3,
            "interval_s": INTERVAL,
        },
        "http": {"listen": listen},
        "worker": workers,
        "nats": {"url": nats},
    }
    return write_toml(path, doc)


def _streams(s: Scrape) -> dict[tuple[str, ...], float]:
    return s.by("kvobserve_kv_event_batches_total", STREAM_KEYS)


def _truth_batches(e: Engines) -> dict[tuple[str, ...], float]:
    """Stream labels -> batches the engine published (seqs assigned)."""
    return {(w, n, r): float(inst["batches"]) for w, n, r, inst in e.truth()}


def _truth_blocks(e: Engines) -> dict[tuple[str, ...], float]:
    """Stream labels + medium -> resident blocks in the engine's cache."""
    return {
        (w, n, r, medium): float(len(hashes))
        for w, n, r, inst in e.truth()
        for medium, hashes in inst["resident"].items()
    }


def test_three_collectors_and_an_aggregator_over_nats(
    nats_server: NatsServer, procs: Procs, engines: Engines, tmp_path: Path
) -> None:
    agg_port = free_port()
    agg = f"http://127.0.0.1:{agg_port}"
    agg_pid = procs.kvobserve(
        "aggregate", "aggregate", "--nats", nats_server.url, "--cluster", CLUSTER,
        "--listen", f"127.0.0.1:{agg_port}",
    )  # fmt: skip
    local: dict[str, str] = {}  # collector id -> its own /metrics base URL
    for k in range(3):
        port = free_port()
        local[f"node-{k}"] = f"http://127.0.0.1:{port}"
        cfg = _collector_toml(
            tmp_path / f"node-{k}.toml",
            f"node-{k}",
            k,
            f"127.0.0.1:{port}",
            nats_server.url,
            engines.plan,
        )
        procs.kvobserve(f"node-{k}", "collect", "-c", str(cfg))

    def up_collectors() -> dict[tuple[str, ...], float]:
        s = scrape(agg)
        assert procs.alive(agg_pid), procs.log(agg_pid)
        return s.by("kvobserve_collector_up", ("collector", "node_rank")) if s else {}

    want_up = {(f"node-{k}", str(k)): 1.0 for k in range(3)}
    until(lambda: up_collectors() == want_up, 30, "three collectors up", up_collectors)

    # --- the engines start publishing: every stream exactly once, rightly labelled ----------
    engines.start()
    want_streams = {(w, str(n), str(r)) for (w, r), n in OWNER.items()}

    def flowing() -> Scrape | None:
        s = scrape(agg)
        if s is None or set(_streams(s)) != want_streams:
            return None
        ok = all(v > 0 for v in _streams(s).values()) and all(
            v == 1 for v in s.by("kvobserve_stream_up", STREAM_KEYS).values()
        )
        return s if ok else None

    s = until(flowing, 20, "12 streams up with batches", lambda: scrape(agg))
    info = s.by("kvobserve_stream_info", (*STREAM_KEYS, "collector", "engine"))
    assert set(info) == {(w, n, r, f"node-{n}", w.split("-")[0]) for w, n, r in want_streams}, (
        "each stream once, from the collector of its node"
    )
    assert s.by("kvobserve_stream_up", STREAM_KEYS) == dict.fromkeys(want_streams, 1.0)
    owners = {(w, str(r)): 1.0 for (w, r) in OWNER}
    assert s.by("kvobserve_dp_rank_owners", ("worker_id", "dp_rank")) == owners
    assert s.by("kvobserve_worker_dp_size", ("worker_id",)) == {
        ("sglang-dp8",): 8,
        ("vllm-dp4",): 4,
    }
    assert s.by("kvobserve_worker_leaders", ("worker_id",)) == {
        ("sglang-dp8",): 1,
        ("vllm-dp4",): 1,
    }

    # --- nats-server restarts while the engines publish --------------------------------------
    assert all(n < MAX_BATCHES for n in _truth_batches(engines).values()), (
        "engines finished too early"
    )
    nats_server.restart()

    def reconnected() -> bool:
        s = scrape(agg)
        return (
            s is not None
            and s.by("kvobserve_nats_reconnects_total", ()).get((), 0) >= 1
            and all(v == 1 for v in s.by("kvobserve_collector_up", ("collector",)).values())
        )

    until(reconnected, 15, "aggregator reconnected, collectors up again", lambda: scrape(agg))

    # --- a fourth collector claims node_rank 2 again: its ranks have two owners --------------
    dup_port = free_port()
    dup_cfg = _collector_toml(
        tmp_path / "node-2b.toml",
        "node-2b",
        2,
        f"127.0.0.1:{dup_port}",
        nats_server.url,
        engines.plan,
    )
    dup_pid = procs.kvobserve("node-2b", "collect", "-c", str(dup_cfg))
    doubled = {("sglang-dp8", "6"), ("sglang-dp8", "7"), ("vllm-dp4", "3")}
    owners_dup = {k: (2.0 if k in doubled else 1.0) for k in owners}

    def owner_counts() -> dict[tuple[str, ...], float]:
        s = scrape(agg)
        return s.by("kvobserve_dp_rank_owners", ("worker_id", "dp_rank")) if s else {}

    until(lambda: owner_counts() == owners_dup, 20, "node-2b doubles node 2's ranks", owner_counts)
    assert up_collectors() == {**want_up, ("node-2b", "2"): 1.0}
    s = until(lambda: scrape(agg), 5, "scrape")
    info = s.by("kvobserve_stream_info", (*STREAM_KEYS, "collector"))
    assert {k[3] for k in info if k[:3] == ("vllm-dp4", "2", "3")} == {"node-2", "node-2b"}
    assert set(_streams(s)) == want_streams  # one value per stream, though two collectors send it

    # --- SIGTERM: the collector reads down within 3 intervals, and owns nothing any more ----
    rc, took = procs.terminate(dup_pid)
    assert rc == 0, procs.log(dup_pid)
    assert took < 2.0, f"collect took {took:.2f} s to stop"
    # its last snapshot left at most one interval before SIGTERM; 3 intervals + scrape slack
    deadline = 3 * INTERVAL + 1.0 - took
    until(
        lambda: up_collectors().get(("node-2b", "2")) == 0.0,
        deadline,
        "node-2b down within 3 intervals",
        up_collectors,
    )
    assert owner_counts() == owners

    # --- the engines finish: the aggregator converges to the collectors' and the truth's counts
    until(
        lambda: all(n == MAX_BATCHES for n in _truth_batches(engines).values()),
        20,
        "engines finished",
    )
    truth = _truth_batches(engines)

    def converged() -> bool:
        s = scrape(agg)
        return s is not None and _streams(s) == truth

    until(converged, 15, "aggregator counts == truth", lambda: (truth, scrape(agg)))
    final = scrape(agg)
    assert final is not None
    assert final.by("kvobserve_kv_blocks", (*STREAM_KEYS, "medium")) == _truth_blocks(engines)
    for cid, base in local.items():
        mine = scrape(base)
        assert mine is not None, f"{cid}: no local /metrics on {base}"
        node = cid.split("-")[1]
        want = {k: v for k, v in truth.items() if k[1] == node}
        assert _streams(mine) == want, f"{cid}'s local /metrics"
