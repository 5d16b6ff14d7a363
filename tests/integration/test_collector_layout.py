"""Acceptance: one collector per node watches every DP rank of a multi-node worker exactly once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AsyncExitStack

import pytest

from kvobserve.analysis.conditions import active
from kvobserve.analysis.fleet import FleetState
from kvobserve.simulate import SimConfig, SimulatorGroup, nodes_of
from tests.integration.collector_helpers import (
    all_streams,
    collector_config,
    resident,
    running_collector,
    truth_instance,
    truth_resident,
    wait_connected,
    wait_snapshot,
)

pytestmark = pytest.mark.integration
DP_SIZE = 8


@pytest.fixture
def group(request: pytest.FixtureRequest) -> Iterator[SimulatorGroup]:
    fmt, nnodes = request.param
    cfg = SimConfig(
        format=fmt, dp_size=DP_SIZE, nnodes=nnodes, rate=1000.0, max_batches=30,
        start_delay_s=0.8, http_port=None, prompts=40,
    )  # fmt: skip
    g = SimulatorGroup(nodes_of(cfg)).start()
    yield g
    g.stop()


@pytest.mark.parametrize(
    "group",
    [("sglang-0.5.23", 2), ("sglang-0.5.23", 3), ("vllm-0.33", 2), ("vllm-0.33", 3)],
    indirect=True,
    ids=[
        "sglang-dp-attention-2-nodes",
        "sglang-dp-attention-3-nodes",
        "vllm-2-nodes",
        "vllm-3-nodes",
    ],
)
async def test_every_rank_is_watched_exactly_once_across_nodes(group: SimulatorGroup) -> None:
    nodes = group.workers
    first = nodes[0]
    kv = f"tcp://127.0.0.1:{first.kv_base}"
    replay = f"tcp://127.0.0.1:{first.replay_base}"
    async with AsyncExitStack() as stack:
        cols = []
        for k in range(len(nodes)):
            cfg = collector_config(
                first.fmt.engine, kv_endpoint=kv, replay_endpoint=replay, dp_size=DP_SIZE,
                node_rank=k, nnodes=len(nodes), collector_id=f"node-{k}",
            )  # fmt: skip
            cols.append(await stack.enter_async_context(running_collector(cfg)))
        for col in cols:
            await wait_connected(col)
        left = min(n.started_at + n.cfg.start_delay_s for n in nodes) - time.monotonic()
        assert left > 0, "slow joiner: collectors connected after publishing began"
        snaps = [
            await wait_snapshot(col, all_streams(lambda s: s.batches_total == 30), what="batches")
            for col in cols
        ]
        owned = sorted(r for snap in snaps for w in snap.workers for r in w.ranks_owned)
        watched = sorted(s.dp_rank for snap in snaps for s in snap.streams)
        assert owned == watched == list(range(DP_SIZE))
        for snap, node in zip(snaps, nodes, strict=True):
            hosted = node.cfg.hosted_ranks()
            assert [s.dp_rank for s in snap.streams] == snap.workers[0].ranks_owned == hosted
        assert [w.leader for snap in snaps for w in snap.workers] == [True] + [False] * (
            len(nodes) - 1
        )
        # only the node with the last rank probes the port past it
        assert [[u.dp_rank for u in snap.unexpected] for snap in snaps] == [[]] * (
            len(nodes) - 1
        ) + [[DP_SIZE]]
        # the snapshots were waited for one after the other: a loaded machine may put them more
        # than three intervals apart, which is not what this test is about
        fleet = FleetState(stale_intervals=1000.0)
        for snap in snaps:
            fleet.update(snap, snap.time)
        view = fleet.view(max(s.time for s in snaps))
        assert {k: len(v) for k, v in view.owners.items()} == {("w", r): 1 for r in range(DP_SIZE)}
        assert not [c.kind for c in active(view) if c.kind.startswith("dp_rank")]
        for col, node in zip(cols, nodes, strict=True):
            truth = node.truth()
            for r in node.cfg.hosted_ranks():
                assert await resident(col, "w", r) == truth_resident(truth_instance(truth, r))
