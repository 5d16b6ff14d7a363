"""Dynamo's event plane as a source: the simulator's Dynamo mode (a 2-node dp8 worker, node k on
127.0.0.(k+1)) into a real `kvobserve run`, over a real nats-server (core NATS) and over ZMQ direct
PUBs, with faults: lost messages (dropped event_ids), a publisher restart (event_id back to 1, new
publisher_id) and two publishers for one rank. Every rank's gaps, lost events, restarts,
duplicate-stream flag and resident blocks must equal the simulator's truth."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks._common import free_port
from kvobserve.analysis.conditions import active
from kvobserve.commands.embedded import start_embedded
from kvobserve.config import Config, load_config
from kvobserve.simulate import FaultConfig, SimConfig
from kvobserve.simulate.group import SimulatorGroup, nodes_of
from tests.integration.conftest import NatsServer
from tests.integration.fleet_helpers import Procs, fetch, write_toml
from tests.polling import until, until_async

pytestmark = pytest.mark.integration

HOSTS = ("127.0.0.1", "127.0.0.2")
FAULTS = FaultConfig(
    ranks=(1, 6),  # rank 1 on node 0, rank 6 on node 1
    drop_event_ids=frozenset({30, 31, 90}),
    restart_every=25,
    second_publisher=(3,),
)


def dynamo_group(plane: str, nats_url: str | None, faults: FaultConfig = FAULTS) -> SimulatorGroup:
    """A 2-node dp8 Dynamo worker; events wait until `publish_now()` (subscribers are ready)."""
    cfg = SimConfig(
        worker_id="dyn", format="sglang-0.5.23", dp_size=8, nnodes=2, node_hosts=HOSTS,
        event_plane=plane, event_plane_url=nats_url, rate=300.0, max_batches=60,
        start_delay_s=600.0, side_interval_s=0.2, http_port=None, replay_port=None, prompts=40,
        faults=faults,
    )  # fmt: skip
    return SimulatorGroup(nodes_of(cfg)).start()


def _visible(lost: list[int], events: int) -> list[list[int]]:
    """The runs of lost event ids a subscriber can see: each between two received events (a
    run from id 1 looks like joining late, a run up to the last id has no successor)."""
    runs: list[list[int]] = []
    for x in sorted(lost):
        if runs and runs[-1][-1] == x - 1:
            runs[-1].append(x)
        else:
            runs.append([x])
    return [run for run in runs if run[0] > 1 and run[-1] < events]


def expected(truth: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Per dp_rank: what a subscriber that received every delivered message must report."""
    out: dict[int, dict[str, Any]] = {}
    for w in truth["workers"]:
        for r, rt in w["ranks"].items():
            primaries = [p for p in rt["publishers"] if p["kind"] == "primary"]
            lost = [p["lost_event_ids"] for p in primaries]
            runs = [run for p in primaries for run in _visible(p["lost_event_ids"], p["events"])]
            out[int(r)] = {
                "gaps": len(runs),
                "lost": sum(len(run) for run in runs),
                "restarts": rt["restarts"],
                "duplicate_stream": any(p["kind"] == "second" for p in rt["publishers"]),
                "blocks": len(primaries[-1]["delivered_resident"]["device"]),
                "state_complete": not (lost[-1] or len(rt["publishers"]) > len(primaries)),
            }
    return out


def observed(streams: list[dict[str, Any]], dup_ranks: set[int]) -> dict[int, dict[str, Any]]:
    out = {}
    for s in streams:
        row = {k: s[k] for k in ("gaps", "lost", "restarts", "duplicate_stream", "state_complete")}
        row["blocks"] = s["blocks"].get("GPU", 0)
        out[s["dp_rank"]] = row
    return out


def comparable(rows: dict[int, dict[str, Any]], dup_ranks: set[int]) -> dict[int, dict[str, Any]]:
    """Two interleaved publishers make a rank's index meaningless: compare only the flag there."""
    return {
        r: ({"duplicate_stream": v["duplicate_stream"]} if r in dup_ranks else v)
        for r, v in rows.items()
    }


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.stop_all()


def _run_and_check(
    tmp_path: Path, procs: Procs, group: SimulatorGroup, worker: dict[str, Any]
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    config = write_toml(
        tmp_path / "kvobserve.toml",
        {"collector": {"interval_s": 0.2}, "worker": [worker]},
    )
    pid = procs.kvobserve("run", "run", "-c", str(config), "--listen", f"127.0.0.1:{port}")

    def fleet_ranks() -> set[int]:
        text = fetch(f"{base}/api/v1/fleet")
        if text is None:
            return set()
        workers = [w for w in json.loads(text)["workers"] if w["worker_id"].startswith("dynamo/")]
        return {int(r) for w in workers for r in w["owners"] if w["owners"][r]}

    # the ranks' load heartbeats reach the collector: it is subscribed, events may start
    until(lambda: fleet_ranks() == set(range(8)), 30, "all 8 ranks beat", lambda: procs.log(pid))
    for w in group.dynamo:
        w.publish_now()
    until(lambda: all(w._finished() for w in group.dynamo), 30, "the simulator published all")
    want = comparable(expected(group.truth()), {3})

    def got() -> dict[int, dict[str, Any]]:
        text = fetch(f"{base}/api/v1/streams")
        streams = [s for s in json.loads(text or "[]") if s["engine"] == "dynamo"]
        return comparable(observed(streams, {3}), {3})

    until(lambda: got() == want, 30, "streams equal the truth", lambda: f"{got()}\n!=\n{want}")
    # the faults did happen (a broken simulator would make the comparison vacuous)
    assert want[1]["gaps"] >= 1 and want[6]["gaps"] >= 1
    assert {r for r, v in want.items() if v.get("restarts")} == {1, 6}
    assert want[3] == {"duplicate_stream": True}
    assert all(v["blocks"] > 0 for r, v in want.items() if r != 3)


def test_nats_event_plane_into_run(tmp_path: Path, procs: Procs) -> None:
    nats = NatsServer(tmp_path / "js", jetstream=False)
    nats.start()
    group = None
    try:
        group = dynamo_group("nats", nats.url)
        worker = {"engine": "dynamo", "event_plane_url": nats.url, "namespace": "dynamo",
                  "block_size": 16, "dp_size": 8}  # fmt: skip
        _run_and_check(tmp_path, procs, group, worker)
    finally:
        if group is not None:
            group.stop()
        nats.stop()


def test_zmq_direct_event_plane_into_run(tmp_path: Path, procs: Procs) -> None:
    group = dynamo_group("zmq", None)
    try:
        endpoints = [e.url for e in group.endpoints() if e.kind in ("dynamo_kv", "dynamo_metrics")]
        assert {ep.split("//")[1].rsplit(":", 1)[0] for ep in endpoints} == set(HOSTS)
        worker = {"engine": "dynamo", "event_plane": "zmq", "zmq_endpoints": endpoints,
                  "block_size": 16, "dp_size": 8}  # fmt: skip
        _run_and_check(tmp_path, procs, group, worker)
    finally:
        group.stop()


async def test_each_node_keeps_its_own_share_of_a_namespace(tmp_path: Path) -> None:
    """keep_ranks = "node": both collectors see the whole namespace on NATS, each keeps its
    node's ranks, so every rank has exactly one owner; a silent collector leaves its ranks
    uncovered."""
    nats = NatsServer(tmp_path / "js", jetstream=False)
    nats.start()
    group = emb = None
    try:
        group = dynamo_group("nats", nats.url, faults=FaultConfig())

        def node(k: int) -> Config:
            settings = {
                "collector.id": f"c{k}",
                "collector.node_rank": k,
                "collector.nnodes": 2,
                "collector.interval_s": 0.2,
                "worker.engine": "dynamo",
                "worker.event_plane_url": nats.url,
                "worker.dp_size": 8,
                "worker.keep_ranks": "node",
            }
            return load_config(None, settings, {})

        configs = [node(0), node(1)]
        emb = await start_embedded(configs, None)
        label = f"dynamo/{group.dynamo[0].worker_id}"
        want = {(label, r): [f"c{r // 4}"] for r in range(8)}

        def owners() -> dict[tuple[str, int], list[str]]:
            assert emb is not None
            return {k: v for k, v in emb.aggregator.view().owners.items() if k[0] == label}

        await until_async(lambda: owners() == want, 30, "one owner per rank, by node")
        for w in group.dynamo:
            w.publish_now()
        await until_async(lambda: all(w._finished() for w in group.dynamo), 30, "published")

        def streams() -> dict[str, set[int]]:
            assert emb is not None
            out: dict[str, set[int]] = {}
            for s in emb.aggregator.view().streams:
                out.setdefault(s.collector.collector_id, set()).add(s.stats.dp_rank)
            return out

        await until_async(
            lambda: streams() == {"c0": {0, 1, 2, 3}, "c1": {4, 5, 6, 7}}, 30, "split"
        )
        assert not [c for c in active(emb.aggregator.view()) if c.kind.startswith("dp_rank")]
        for col in emb.collectors:  # each dropped the other node's events
            snap = col.last_snapshot
            assert snap is not None and snap.dynamo_planes[0].not_owned_events > 0
        await emb.collectors[1].close()

        def uncovered() -> set[int]:
            assert emb is not None
            view = emb.aggregator.view()
            return {
                int(dict(c.labels)["dp_rank"])
                for c in active(view)
                if c.kind == "dp_rank_uncovered"
            }

        await until_async(lambda: uncovered() == {4, 5, 6, 7}, 30, "node 1's ranks uncovered")
    finally:
        if emb is not None:
            await emb.close()
        if group is not None:
            group.stop()
        nats.stop()
