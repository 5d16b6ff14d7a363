"""Acceptance: two sharded aggregators over a real nats-server serve, together, one aggregator.

Two `kvobserve collect` processes (node_rank 0 and 1) watch a simulated SGLang worker
(`sglang-dp4`, dp_size 4, bucket 62: shard 0 of 2) and a vLLM worker (`vllm-dp2`, dp_size 2,
bucket 23: shard 1 of 2), so each collector publishes two parts. Three `kvobserve aggregate`
processes serve them: one unsharded, shard 0 and shard 1 of 2. The shards' scrapes, put
together, are the unsharded one: every stream and worker series in exactly one shard, and the
per-collector and aggregator series in both, told apart by their `shard` label.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvobserve.export.catalog import SHARD_LABELLED
from kvobserve.simulate import SimConfig, SimulatedWorker, nodes_of
from kvobserve.simulate.ports import free_port
from kvobserve.wire.parts import worker_bucket
from tests.integration.conftest import NatsServer
from tests.integration.fleet_helpers import Procs, Scrape, scrape, worker_tables, write_toml
from tests.polling import until

pytestmark = pytest.mark.integration

CLUSTER = "shards"
MAX_BATCHES = 60
SGLANG = SimConfig(
    worker_id="sglang-dp4", format="sglang-0.5.23", dp_size=4, nnodes=2, dp_attention=True,
    topic="kv-events", rate=40.0, max_batches=MAX_BATCHES, start_delay_s=0.5, http_port=None,
    prompts=20, seed=3,
)  # fmt: skip
VLLM = dataclasses.replace(SGLANG, worker_id="vllm-dp2", format="vllm-0.33", dp_size=2, topic="")
SHARD_OF = {"sglang-dp4": "0", "vllm-dp2": "1"}  # worker_bucket(w) % 2
Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.stop_all()


@pytest.fixture
def engines() -> Iterator[list[SimulatedWorker]]:
    started: list[SimulatedWorker] = []
    yield started
    for sim in started:
        sim.stop()


def _collector_toml(path: Path, k: int, nats: str, plan: list[list[SimConfig]]) -> Path:
    workers = worker_tables(plan)
    doc = {
        "cluster": CLUSTER,
        "collector": {"id": f"node-{k}", "node_rank": k, "nnodes": 2, "interval_s": 0.5},
        "http": {"listen": ""},
        "worker": workers,
        "nats": {"url": nats, "jetstream_kv": True},
    }
    return write_toml(path, doc)


def _series(s: Scrape) -> Series:
    return {
        (name, frozenset(labels.items())): value
        for name, samples in s.samples.items()
        for labels, value in samples
    }


def _aggregate(procs: Procs, name: str, nats: str, *shard: str) -> str:
    port = free_port()
    procs.kvobserve(
        name, "aggregate", "--nats", nats, "--cluster", CLUSTER, "--jetstream-kv",
        "--listen", f"127.0.0.1:{port}", *shard,
    )  # fmt: skip
    return f"http://127.0.0.1:{port}"


def test_two_shards_serve_what_one_aggregator_serves(
    nats_server: NatsServer, procs: Procs, engines: list[SimulatedWorker], tmp_path: Path
) -> None:
    assert {w: str(worker_bucket(w) % 2) for w in SHARD_OF} == SHARD_OF
    plan = [nodes_of(SGLANG), nodes_of(VLLM)]
    whole = _aggregate(procs, "whole", nats_server.url)
    shards = {
        i: _aggregate(procs, f"shard-{i}", nats_server.url, "--shards", "2", "--shard", i)
        for i in ("0", "1")
    }
    collectors = [
        procs.kvobserve(
            f"node-{k}", "collect", "-c", str(_collector_toml(tmp_path / f"{k}.toml", k, nats_server.url, plan))
        )
        for k in (0, 1)
    ]  # fmt: skip

    def collectors_up() -> bool:  # subscribed before the engines publish
        s = scrape(whole)
        return s is not None and len(s.get("kvobserve_collector_up")) == 2

    until(collectors_up, 30, "both collectors publishing")
    for nodes in plan:
        for cfg in nodes:
            engines.append(SimulatedWorker(cfg).start())
    until(
        lambda: all(sim.truth()["ranks"] and _done(sim) for sim in engines),
        30,
        "engines finished publishing",
    )
    truth = {
        (t["worker_id"], rank): float(st["instances"][0]["batches"])
        for t in (sim.truth() for sim in engines)
        for rank, st in t["ranks"].items()
    }

    def settled(base: str) -> Scrape | None:
        s = scrape(base)
        if s is None:
            return None
        got = s.by("kvobserve_kv_event_batches_total", ("worker_id", "dp_rank"))
        mine = {k: v for k, v in truth.items() if base == whole or SHARD_OF[k[0]] == _shard(base)}
        return s if got == mine else None

    def _shard(base: str) -> str:
        return next(i for i, b in shards.items() if b == base)

    one = _series(
        until(
            lambda: settled(whole),
            30,
            "the unsharded aggregator has every stream",
            lambda: (truth, scrape(whole)),
        )
    )
    parts = {i: _series(until(lambda b=b: settled(b), 30, f"shard {i}")) for i, b in shards.items()}

    # Every series either carries its shard's label (the per-collector and own ones) or is in
    # exactly one shard; nothing else carries a `shard` label.
    plain: Series = {}
    labelled: dict[str, Series] = {}
    for i, series in parts.items():
        for (name, labels), value in series.items():
            lb = dict(labels)
            if "shard" in lb:
                assert name in SHARD_LABELLED, f"{name} carries shard"
                assert lb.pop("shard") == i
                labelled.setdefault(i, {})[(name, frozenset(lb.items()))] = value
            else:
                assert name not in SHARD_LABELLED, f"{name} without shard in shard {i}"
                key = (name, labels)
                assert key not in plain, f"{name}{lb} served by both shards"
                plain[key] = value
    # ... and the union is the unsharded scrape: the same series and the same values
    per_process = {k for k in one if k[0] in SHARD_LABELLED}
    assert set(plain) == set(one) - per_process
    assert plain == {k: v for k, v in one.items() if k not in per_process}
    # Both shards hear both collectors: their health series are the unsharded ones, once each
    collector_level = {k for k in per_process if k[0].startswith("kvobserve_collector_")}
    for i in shards:
        assert collector_level <= set(labelled[i]), f"shard {i} misses collector series"
        for key in collector_level:
            if not key[0].endswith("_age_seconds"):  # wall clock
                assert labelled[i][key] == one[key], (i, key)
    # Ownership stays exact per shard: each worker's ranks have one owner, in its own shard
    for i, base in shards.items():
        s = scrape(base)
        assert s is not None
        owners = s.by("kvobserve_dp_rank_owners", ("worker_id", "dp_rank"))
        assert owners and all(v == 1.0 for v in owners.values())
        assert {w for w, _ in owners} == {w for w, sh in SHARD_OF.items() if sh == i}

    # Warm start per shard: the collectors stop; a new shard 1 reads its parts from the KV bucket
    for pid in collectors:
        assert procs.terminate(pid)[0] == 0
    late = _aggregate(procs, "late-shard-1", nats_server.url, "--shards", "2", "--shard", "1")

    def warm() -> Scrape | None:
        s = scrape(late)
        return s if s and s.get("kvobserve_kv_event_batches_total") else None

    s = until(warm, 15, "the late shard serves streams, read from the KV bucket")
    got = s.by("kvobserve_kv_event_batches_total", ("worker_id", "dp_rank"))
    assert got == {k: v for k, v in truth.items() if SHARD_OF[k[0]] == "1"}
    assert set(s.by("kvobserve_collector_up", ("collector", "shard"))) == {
        ("node-0", "1"),
        ("node-1", "1"),
    }


def _done(sim: SimulatedWorker) -> bool:
    return all(
        st["instances"] and st["instances"][0]["batches"] >= MAX_BATCHES
        for st in sim.truth()["ranks"].values()
    )
