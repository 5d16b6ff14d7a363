"""Router-index drift against the simulated Dynamo KV indexer (real HTTP, ZMQ direct plane):
an indexer that lags, loses removals or misses a worker gives exactly the phantom and missing
blocks the simulator injected; a faithful one gives none, also while events are in flight."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from kvobserve.analysis.conditions import active
from kvobserve.collector import Collector
from kvobserve.commands.demo import start_demo
from kvobserve.config import load_config
from kvobserve.simulate import SimConfig
from kvobserve.simulate.dynamo_worker import SimulatedDynamoWorker
from kvobserve.simulate.group import SimulatorGroup
from kvobserve.transport.local import LocalBus
from tests.polling import until_async

pytestmark = pytest.mark.integration


def sim(worker_id: str = "a", **kw: Any) -> SimConfig:
    """A small Dynamo worker on ZMQ direct whose cache evicts (removals happen)."""
    base: dict[str, Any] = {
        "worker_id": worker_id, "format": "vllm-0.33", "dp_size": 2, "event_plane": "zmq",
        "rate": 400.0, "max_batches": 80, "start_delay_s": 600.0, "side_interval_s": 0.1,
        "http_port": None, "replay_port": None, "prompts": 60, "capacity_tokens": 1024,
    }  # fmt: skip
    base.update(kw)
    return SimConfig(**base)


@asynccontextmanager
async def running(configs: list[SimConfig], api: str = "dump") -> AsyncIterator[Any]:
    """The simulators and a collector measuring drift against their indexer (polled by hand)."""
    group = SimulatorGroup(configs).start()
    col = None
    try:
        eps = [e.url for e in group.endpoints() if e.kind in ("dynamo_kv", "dynamo_metrics")]
        url = next(e.url for e in group.endpoints() if e.kind == "indexer")
        cfg = load_config(
            None,
            {"collector.interval_s": 0.2, "worker.engine": "dynamo", "worker.event_plane": "zmq",
             "worker.zmq_endpoints": ",".join(eps), "worker.block_size": 16,
             "worker.indexer_url": url, "worker.indexer_api": api,
             "worker.drift_interval_s": 3600.0, "worker.drift_lag_s": 0.2},
            {},
        )  # fmt: skip
        col = Collector(cfg, LocalBus())
        await col.start()
        ranks = {(w.worker_id, r.rank) for w in group.dynamo for r in w.ranks}

        async def beating() -> bool:
            snap = await col.snapshot()
            return len({(s.worker_id, s.dp_rank) for s in snap.scheduler}) == len(ranks)

        await until_async(beating, 30.0, "every rank's load beats")
        yield group, col
    finally:
        if col is not None:
            await col.close()
        group.stop()


async def settled(group: SimulatorGroup, col: Collector) -> None:
    """Wait until the simulators are done and the collector holds what they delivered."""
    await until_async(lambda: all(w._finished() for w in group.dynamo), 30, "published all")
    want = {}
    for w in group.dynamo:
        for st in w.ranks:
            blocks = len(st.publishers[0].delivered.get("device", ()))
            want[(f"dynamo/{w.worker_id}", st.rank)] = (st.publishers[0].next_event_id - 1, blocks)

    async def done() -> bool:
        snap = await col.snapshot()
        got = {
            (s.worker_id, s.dp_rank): (s.batches_total, sum(m.blocks for m in s.media))
            for s in snap.streams
        }
        return got == want

    await until_async(done, 30.0, "the collector holds every delivered event")


def injected(group: SimulatorGroup) -> dict[tuple[str, int, str], tuple[int, int]]:
    """(worker_id label, dp_rank, medium) -> (phantom, missing) as the simulator injected."""
    out = {}
    for key, v in group.truth()["indexer"]["streams"].items():
        wid, rank, tier = key.split("/")
        assert tier == "device"
        out[(f"dynamo/{wid}", int(rank), "GPU")] = (v["phantom"], v["missing"])
    return out


async def measured(col: Collector) -> dict[tuple[str, int, str], tuple[int, int]]:
    poller = col.drift[0]
    assert await poller.compare_once() == "ok"
    results, source = poller.stats()
    assert source.comparisons.get("ok", 0) >= 1 and source.unseen_streams == 0
    return {(d.worker_id, d.dp_rank, d.medium): (d.phantom, d.missing) for d in results}


@pytest.mark.parametrize(
    ("mode", "kw"),
    [("lag", {"indexer_lag_events": 6}), ("lose_removals", {})],
)
async def test_drift_equals_what_the_indexer_got_wrong(mode: str, kw: dict[str, Any]) -> None:
    async with running([sim(indexer_port=0, indexer_mode=mode, **kw)]) as (group, col):
        for w in group.dynamo:
            w.publish_now()
        await settled(group, col)
        want = injected(group)
        got = await measured(col)
        assert got == want
        phantom = sum(p for p, _ in want.values())
        missing = sum(m for _, m in want.values())
        assert phantom > 0  # both modes leave blocks the engine evicted in the router
        assert (missing > 0) == (mode == "lag")  # a lagging router also lacks the newest ones


async def test_an_indexer_missing_a_worker() -> None:
    configs = [
        sim("a", indexer_port=0, indexer_mode="miss_worker", indexer_miss_worker="b"),
        sim("b", seed=7),
    ]
    async with running(configs) as (group, col):
        for w in group.dynamo:
            w.publish_now()
        await settled(group, col)
        want = injected(group)
        got = await measured(col)
        assert got == want
        b = f"dynamo/{group.dynamo[1].worker_id}"
        assert all(v == (0, 0) for k, v in got.items() if k[0] != b)  # worker a is faithful
        assert all(v[0] == 0 and v[1] > 0 for k, v in got.items() if k[0] == b)


async def test_a_faithful_indexer_shows_no_drift_even_while_events_fly() -> None:
    cfg = sim(indexer_port=0, indexer_mode="faithful", rate=150.0, max_batches=600)
    async with running([cfg]) as (group, col):
        for w in group.dynamo:
            w.publish_now()
        poller = col.drift[0]
        for _ in range(3):  # during traffic: whatever changed in the window is in flight
            assert await poller.compare_once() == "ok"
            results, _ = poller.stats()
            assert results and all((d.phantom, d.missing) == (0, 0) for d in results), results
            assert all(d.complete for d in results)
        assert not all(w._finished() for w in group.dynamo)  # it was measured under traffic
        await settled(group, col)
        assert set((await measured(col)).values()) == {(0, 0)}


async def test_size_comparison_against_query_tree_sizes() -> None:
    cfg = sim(indexer_port=0, indexer_mode="lose_removals")
    async with running([cfg], api="query") as (group, col):
        for w in group.dynamo:
            w.publish_now()
        await settled(group, col)
        truth = group.truth()["indexer"]["streams"]
        poller = col.drift[0]
        assert await poller.compare_once() == "ok"
        results, source = poller.stats()
        assert source.method == "size" and results
        for d in results:
            t = truth[f"{d.worker_id.split('/')[1]}/{d.dp_rank}/device"]
            assert d.method == "size" and d.jaccard is None
            assert (d.router_blocks, d.engine_blocks) == (t["router_blocks"], t["engine_blocks"])
            # lost removals only add blocks: the size difference is exactly the phantom count
            assert (d.phantom, d.missing) == (t["phantom"], 0)


async def test_demo_with_a_dynamo_worker_measures_its_indexer() -> None:
    demo = await start_demo(None, rate=100.0, interval_s=0.2, dynamo=True, drift_interval_s=1.0)
    try:
        dyn = next(s for s in demo.sims if isinstance(s, SimulatedDynamoWorker))
        label = f"dynamo/{dyn.worker_id}"
        col = next(c for c in demo.kvobserve.collectors if c.info.collector_id == "dynamo-node-0")

        def measured() -> bool:
            view = demo.kvobserve.aggregator.view()
            up = {s.stats.dp_rank for s in view.streams if s.stats.worker_id == label and s.up}
            snap = col.last_snapshot
            drift = [] if snap is None else [d for d in snap.drift if d.worker_id == label]
            # the indexer loses removals: evicted blocks stay in the router as phantoms
            return up == {0, 1, 2, 3} and any(d.phantom for d in drift)

        await until_async(measured, 30, "the demo's Dynamo worker is watched and drifts")
        view = demo.kvobserve.aggregator.view()
        kinds = {c.kind for c in active(view) if dict(c.labels).get("worker_id") == label}
        assert "dp_rank_uncovered" not in kinds
    finally:
        await demo.close()
