"""Acceptance: a collector given only the engine's URL finds its KV-event streams and watches them."""

from __future__ import annotations

import pytest

from kvobserve.simulate import FaultConfig
from tests.integration.collector_helpers import (
    Sims,
    all_streams,
    collector_config,
    resident,
    running_collector,
    sim_config,
    stream,
    truth_instance,
    truth_resident,
    wait_connected,
    wait_snapshot,
)

pytestmark = pytest.mark.integration


# SGLang 0.5.23 advertises per-rank sources in /server_info; vLLM 0.33 serves /kv_event_sources
@pytest.mark.parametrize(("fmt", "engine"), [("sglang-0.5.23", "sglang"), ("vllm-0.33", "vllm")])
async def test_only_the_engine_url_is_enough(fmt: str, engine: str, sims: Sims) -> None:
    # a dropped batch proves the replay endpoint was discovered too
    faults = FaultConfig(drop_seqs=frozenset({7}))
    sim = sims.start(
        sim_config(fmt, dp_size=3, topic="kv-events", http_port=0, faults=faults), held=True
    )
    url = f"http://127.0.0.1:{sim.http_port}"
    cfg = collector_config(engine, worker_id=None, url=url, dp_attention=None)
    assert cfg.workers[0].kv_endpoint is None and cfg.workers[0].dp_size is None
    wid = f"{engine}@127.0.0.1:{sim.http_port}"
    async with running_collector(cfg) as col:
        snap = await wait_connected(col, sim)
        assert [(s.worker_id, s.dp_rank, s.endpoint, s.topic) for s in snap.streams] == [
            (wid, r, f"tcp://127.0.0.1:{sim.kv_base + r}", "kv-events") for r in range(3)
        ]
        assert [(w.worker_id, w.dp_size, w.ranks_owned) for w in snap.workers] == [
            (wid, 3, [0, 1, 2])
        ]
        assert [u.endpoint for u in snap.unexpected] == [f"tcp://127.0.0.1:{sim.kv_base + 3}"]
        snap = await wait_snapshot(
            col,
            all_streams(lambda s: s.batches_total == 60 and s.replay_requests == {"ok": 1}),
            what="every batch applied",
        )
        truth = sim.truth()
        for r in range(3):
            st = stream(snap, r, wid)
            assert (st.missed, st.recovered, st.lost) == (1, 1, 0)
            assert await resident(col, wid, r) == truth_resident(truth_instance(truth, r))
