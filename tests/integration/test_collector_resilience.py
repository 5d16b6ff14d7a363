"""Acceptance: an engine that is not up yet, malformed payloads, and a bad `kvobserve collect` config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvobserve.simulate import FaultConfig
from kvobserve.simulate.ports import free_port_range
from tests.integration.collector_helpers import (
    Sims,
    all_streams,
    collector_config,
    resident,
    running_collector,
    sim_collector_config,
    sim_config,
    stream,
    truth_instance,
    truth_resident,
    wait_connected,
    wait_snapshot,
)
from tests.polling import until_async

pytestmark = pytest.mark.integration
MALFORMED = frozenset({5, 6, 30})  # two gaps: seqs 5-6, then 30


async def test_engine_not_up_yet_then_up(sims: Sims) -> None:
    kv, replay = free_port_range("127.0.0.1", 3), free_port_range("127.0.0.1", 2)
    cfg = collector_config(
        "vllm",
        kv_endpoint=f"tcp://127.0.0.1:{kv}",
        replay_endpoint=f"tcp://127.0.0.1:{replay}",
        dp_size=2,
    )
    async with running_collector(cfg) as col:
        # a few snapshot intervals with nothing listening: reported down, nothing crashes
        await until_async(lambda: col.snapshots_published >= 3, 10.0, "snapshots while engine down")
        snap = await col.snapshot()
        assert [(s.dp_rank, s.up, s.batches_total) for s in snap.streams] == [
            (0, False, 0),
            (1, False, 0),
        ]
        sim = sims.start(sim_config("vllm-0.33", kv_port=kv, replay_port=replay), held=True)
        await wait_connected(col, sim)
        snap = await wait_snapshot(
            col, all_streams(lambda s: s.batches_total == 60), what="batches"
        )
        truth = sim.truth()
        for r in (0, 1):
            st = stream(snap, r)
            assert (st.up, st.gaps, st.lost, st.state_complete) == (True, 0, 0, True)
            assert await resident(col, "w", r) == truth_resident(truth_instance(truth, r))


@pytest.mark.parametrize("replay", [False, True], ids=["no-replay", "replay"])
async def test_malformed_payloads_are_counted_and_the_rest_applied(
    replay: bool, sims: Sims
) -> None:
    faults = FaultConfig(ranks=(0,), malformed_seqs=MALFORMED)
    sim = sims.start(sim_config("sglang-0.5.23", faults=faults), held=True)
    async with running_collector(sim_collector_config(sim, replay=replay)) as col:
        await wait_connected(col, sim)
        snap = await wait_snapshot(
            col,
            lambda s: (
                stream(s, 0).batches_total == 57
                and stream(s, 1).batches_total == 60
                and bool(stream(s, 0).replay_requests) is replay
                and not stream(s, 0).replaying
            ),
            what="batches applied, replays done",
        )
        truth = sim.truth()
        assert set(truth_instance(truth, 0)["malformed_seqs"]) == MALFORMED
        st = stream(snap, 0)
        # with replay the ring returns the same bad bytes: still one error per bad batch
        assert st.decode_errors == {"msgpack": 3}
        assert (st.gaps, st.missed, st.recovered, st.lost) == (2, 3, 0, 3)
        assert st.state_complete is False
        # one replay per gap (each partial: the bad bytes again); under load the second gap can
        # be seen while the first replay is being asked for, and one replay covers both
        assert st.replay_requests in (({"partial": 2}, {"partial": 1}) if replay else ({},))
        assert stream(snap, 1).decode_errors == {}
        # malformed batches carry no cache change, so everything else gives the exact truth
        for r in (0, 1):
            assert await resident(col, "w", r) == truth_resident(truth_instance(truth, r))


BAD_CONFIGS = {
    "engine": (
        '[[worker]]\nengine = "tgi"\nkv_endpoint = "tcp://127.0.0.1:5557"\n',
        "worker[0].engine",
    ),
    "node_rank": (
        '[collector]\nnode_rank = 2\nnnodes = 2\n[[worker]]\nengine = "vllm"\n'
        'kv_endpoint = "tcp://127.0.0.1:5557"\n',
        "collector.node_rank",
    ),
    "unknown_key": (
        '[[worker]]\nengine = "vllm"\nkv_endpoint = "tcp://127.0.0.1:5557"\ndp_sise = 4\n',
        "worker[0].dp_sise",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_collect_with_a_bad_config_exits_2_naming_the_field(case: str, tmp_path: Path) -> None:
    text, field = BAD_CONFIGS[case]
    path = tmp_path / "kvobserve.toml"
    path.write_text(text)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvobserve",
            "collect",
            "-c",
            str(path),
            "--nats",
            "nats://127.0.0.1:1",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": "/usr/bin:/bin"},  # no KVOBSERVE_* from the environment
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvobserve collect: error: ") and field in lines[0]
    assert proc.stdout == ""
