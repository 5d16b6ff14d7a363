"""Node 1's collector follows an engine restart on new ports: discovery from node 0's URL again.

A 2-node SGLang 0.5.23 worker (node 0 on 127.0.0.1, node 1 on 127.0.0.2) restarts with new KV,
replay and load ports behind the same HTTP port; the collector of node 1, given node 0's URL
only, re-plans: its streams and its load subscribers move to the new ports on its own address.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator

import pytest

from kvobserve.config import load_config
from kvobserve.simulate import SimConfig, SimulatorGroup, nodes_of
from kvobserve.simulate.ports import free_port_range
from kvobserve.wire.snapshot import Snapshot
from tests.integration.collector_helpers import (
    resident,
    running_collector,
    truth_instance,
    truth_resident,
    wait_snapshot,
)
from tests.polling import until_async

pytestmark = pytest.mark.integration
HOSTS = ("127.0.0.1", "127.0.0.2")


@pytest.fixture
def groups() -> Iterator[list[SimulatorGroup]]:
    started: list[SimulatorGroup] = []
    yield started
    for g in started:
        g.stop()


def _settled(g: SimulatorGroup, batches: int) -> Callable[[Snapshot], bool]:
    """Node 1's streams at its own address on `g`'s ports, `batches` in, usage from `g`."""
    n1 = g.workers[1]

    def check(snap: Snapshot) -> bool:
        eps = [(s.dp_rank, s.endpoint, s.batches_total) for s in snap.streams]
        want = [(r, f"tcp://127.0.0.2:{n1.kv_base + r}", batches) for r in (2, 3)]
        sched = {s.dp_rank: s.max_total_tokens for s in snap.scheduler}
        return eps == want and sched == {2: 8192.0, 3: 8192.0}

    return check


async def test_node_1_follows_an_engine_restart(groups: list[SimulatorGroup]) -> None:
    port = free_port_range(HOSTS, 1)
    sim = SimConfig(
        format="sglang-0.5.23", dp_size=4, nnodes=2, topic="kv-events", rate=200.0,
        max_batches=60, load_port=0, http_port=port, start_delay_s=0.5, prompts=40,
        capacity_tokens=8192,
    )  # fmt: skip
    groups.append(SimulatorGroup(nodes_of(sim, HOSTS)).start())
    cfg = load_config(
        None,
        {
            "collector.node_rank": 1, "collector.nnodes": 2, "collector.host": "127.0.0.2",
            "collector.interval_s": 0.2, "worker.id": "w", "worker.engine": "sglang",
            "worker.url": f"http://127.0.0.1:{port}",
        },
        {},
    )  # fmt: skip
    async with running_collector(cfg, rediscovery_s=0.2) as col:
        await wait_snapshot(col, _settled(groups[0], 60), what="first engine watched")
        old = groups[0].workers[1]
        old_load = col.scheduler["w"].sources[0].endpoints
        assert old_load == [f"tcp://127.0.0.2:{(old.load_base or 0) + r}" for r in (2, 3)]
        groups[0].stop()  # the engine restarts: new ports, the same HTTP port
        again = dataclasses.replace(sim, seed=9)
        groups.append(SimulatorGroup(nodes_of(again, HOSTS)).start())
        new = groups[1].workers[1]
        assert (new.kv_base, new.load_base) != (old.kv_base, old.load_base)
        # the stream of each rank goes on: its counters add up, a publisher restart is counted
        snap = await wait_snapshot(col, _settled(groups[1], 120), what="the restarted engine")
        assert [(s.restarts, s.lost, s.state_complete) for s in snap.streams] == [(1, 0, True)] * 2
        assert col.scheduler["w"].sources[0].endpoints == [
            f"tcp://127.0.0.2:{(new.load_base or 0) + r}" for r in (2, 3)
        ]
        truth = new.truth()
        for r in (2, 3):
            assert await resident(col, "w", r) == truth_resident(truth_instance(truth, r))


async def test_vllm_before_0_31_one_log_line_and_the_configured_endpoints(
    groups: list[SimulatorGroup], caplog: pytest.LogCaptureFixture
) -> None:
    sim = SimConfig(format="vllm-0.23", dp_size=2, max_batches=30, rate=200.0, start_delay_s=0.5)
    g = SimulatorGroup([sim]).start()
    groups.append(g)
    (w,) = g.workers
    cfg = load_config(
        None,
        {
            "collector.interval_s": 0.2, "worker.id": "w", "worker.engine": "vllm",
            "worker.url": f"http://127.0.0.1:{w.http_port}", "worker.kv_endpoint": f"tcp://*:{w.kv_base}",
            "worker.dp_size": 2,
        },
        {},
    )  # fmt: skip
    caplog.set_level(logging.WARNING, logger="kvobserve")
    async with running_collector(cfg, rediscovery_s=0.05) as col:
        await wait_snapshot(
            col, lambda s: [x.batches_total for x in s.streams] == [30, 30], what="both ranks"
        )
        polls = col._rediscovery[0]
        await until_async(  # the route keeps answering 404
            lambda: polls.errors_total >= 3, 10, "3 rediscovery polls answered 404",
            lambda: f"{polls.errors_total} rediscovery polls",
        )  # fmt: skip
    said = [r.getMessage() for r in caplog.records if "/kv_event_sources" in r.getMessage()]
    assert len(said) == 1, said
    assert "vLLM before 0.31" in said[0] and "kv_endpoint, replay_endpoint and dp_size" in said[0]
