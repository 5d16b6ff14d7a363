"""Acceptance (issue 27): the stream core's fixes through real sockets, end to end.

The behaviours are unit tests of the core (tests/unit/test_stream_core.py); these runs prove the
wiring: engines' bytes (the simulator's vLLM and SGLang publishers) through real ZMQ into a
collector, its snapshots to the aggregator, `/metrics` over HTTP.

- bind mode without a relay: the vLLM publishers connect to the ranks kvobserve binds; every
  scrape of the run answers 200 (it answered 500 while a bind without a relay was served);
- llm-d's central mode (a topic template, no relay): four pods, one killed: its stream is down
  and its cache gauges gone within two collector intervals + 1 s, the others stay up;
- engines that published and went idle before kvobserve started, their rings holding every
  batch: every rank's resident blocks equal the truth within 5 s of kvobserve's start.
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request

import pytest

from kvobserve.commands.embedded import start_embedded
from kvobserve.config import load_config
from kvobserve.simulate import SimConfig, SimulatedWorker
from kvobserve.simulate.ports import free_port, free_port_range
from tests.integration.collector_helpers import (
    Sims,
    resident,
    sim_collector_config,
    sim_finished,
    truth_instance,
    truth_resident,
)
from tests.integration.fleet_helpers import Scrape, scrape

pytestmark = pytest.mark.integration
PODS = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")


def _status(url: str) -> int:
    """The HTTP status of a GET (0: nothing answered)."""
    try:
        with urllib.request.urlopen(url, timeout=5.0) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def _blocks(s: Scrape | None) -> dict[tuple[str, str], float]:
    """kvobserve_kv_blocks by (worker_id, dp_rank)."""
    if s is None:
        return {}
    return {
        (labels["worker_id"], labels["dp_rank"]): v
        for labels, v in s.samples.get("kvobserve_kv_blocks", [])
        if labels.get("medium") == "GPU"
    }


def _up(s: Scrape | None) -> dict[str, float]:
    """kvobserve_stream_up by worker_id."""
    if s is None:
        return {}
    return {labels["worker_id"]: v for labels, v in s.samples.get("kvobserve_stream_up", [])}


async def test_vllm_publishers_connecting_to_a_bound_kvobserve_every_scrape_answers_200(
    sims: Sims,
) -> None:
    port = free_port_range("127.0.0.1", 2)
    sim = sims.start(
        SimConfig(
            worker_id="w", format="vllm-0.33", dp_size=2, host="127.0.0.2",
            kv_connect=f"tcp://127.0.0.1:{port}", rate=200.0, max_batches=600,
            start_delay_s=1.0, http_port=None, prompts=40,
        )
    )  # fmt: skip
    http = free_port()
    cfg = load_config(
        None,
        {"worker.id": "w", "worker.engine": "vllm", "worker.dp_size": 2,
         "worker.bind": f"tcp://127.0.0.1:{port}",
         "worker.replay_endpoint": f"tcp://127.0.0.2:{sim.replay_base}",
         "collector.interval_s": 0.2, "http.listen": f"127.0.0.1:{http}"},
        {},
    )  # fmt: skip
    emb = await start_embedded([cfg], cfg.http)
    try:
        base = f"http://127.0.0.1:{http}"
        statuses: list[int] = []
        end = time.monotonic() + 60.0
        while not sim_finished(sim) or len(statuses) < 10:
            statuses.append(await asyncio.to_thread(_status, f"{base}/metrics"))
            assert time.monotonic() < end, "the engine did not finish"
        truth = sim.truth()
        col = emb.collectors[0]
        for r in (0, 1):  # all applied: the engine's truth, in the index and on /metrics
            want = truth_resident(truth_instance(truth, r))
            deadline = time.monotonic() + 20.0
            while await resident(col, "w", r) != want:
                assert time.monotonic() < deadline, f"rank {r} never matched the truth"
                await asyncio.sleep(0.05)  # polling interval, not synchronization
        got = _blocks(await asyncio.to_thread(scrape, base))
        statuses.append(await asyncio.to_thread(_status, f"{base}/metrics"))
        assert set(statuses) == {200}, statuses
        want_blocks = {(("w", str(r))): len(truth_resident(truth_instance(truth, r))["GPU"])
                       for r in (0, 1)}  # fmt: skip
        deadline = time.monotonic() + 5.0
        while got != want_blocks:
            assert time.monotonic() < deadline, (got, want_blocks)
            got = _blocks(await asyncio.to_thread(scrape, base))
    finally:
        await emb.close()


async def test_four_llm_d_pods_in_central_mode_one_killed_goes_down_alone(sims: Sims) -> None:
    interval = 1.0  # the default collector interval
    port = free_port_range("127.0.0.1", 1)
    replay = free_port_range(list(PODS), 1)
    http = free_port()
    cfg = load_config(
        None,
        {"worker.id": "llmd", "worker.engine": "vllm", "worker.dp_size": 1,
         "worker.bind": f"tcp://127.0.0.1:{port}", "worker.topic": "kv@{pod}@{model}",
         "worker.replay_endpoint": f"tcp://{{pod_ip}}:{replay}",
         "collector.interval_s": interval, "http.listen": f"127.0.0.1:{http}"},
        {},
    )  # fmt: skip
    emb = await start_embedded([cfg], cfg.http)
    pods: list[SimulatedWorker] = []
    try:
        for i, ip in enumerate(PODS):
            pods.append(
                sims.start(
                    SimConfig(
                        worker_id=f"pod-{i}", format="vllm-0.33", dp_size=1, host=ip,
                        kv_connect=f"tcp://127.0.0.1:{port}", replay_port=replay,
                        topic=f"kv@{ip}:8000@m", rate=50.0, max_batches=100_000,
                        start_delay_s=0.5, http_port=None, prompts=40, seed=i,
                    )
                )
            )  # fmt: skip
        ids = [f"llmd/{ip}:8000" for ip in PODS]
        base = f"http://127.0.0.1:{http}"
        deadline = time.monotonic() + 30.0
        while set(_blocks(await asyncio.to_thread(scrape, base))) != {(i, "0") for i in ids}:
            assert time.monotonic() < deadline, "not every pod's blocks served"
            await asyncio.sleep(0.1)  # polling interval, not synchronization
        pods[1].stop()  # one pod dies
        killed = time.monotonic()
        bound = 2 * interval + 1.0
        while True:
            s = await asyncio.to_thread(scrape, base)
            blocks, up = _blocks(s), _up(s)
            if (ids[1], "0") not in blocks and up.get(ids[1]) == 0:
                break
            assert time.monotonic() - killed < bound, (
                f"pod 1 still served {bound} s after it died: up={up} blocks={blocks}"
            )
            await asyncio.sleep(0.05)  # polling interval, not synchronization
        assert {k for k in blocks} == {(i, "0") for i in ids if i != ids[1]}
        assert all(up[i] == 1 for i in ids if i != ids[1]), up
    finally:
        await emb.close()


async def test_engines_idle_before_kvobserve_starts_are_exact_within_5_s(sims: Sims) -> None:
    engines = [
        sims.start(
            SimConfig(
                worker_id=wid, format=fmt, dp_size=2, topic=topic, rate=1000.0,
                max_batches=300, start_delay_s=0.0, http_port=None, prompts=40, seed=seed,
            )
        )
        for wid, fmt, topic, seed in (
            ("sglang", "sglang-0.5.23", "kv-events", 1), ("vllm", "vllm-0.33", "", 2),
        )
    ]  # fmt: skip
    deadline = time.monotonic() + 30.0
    while not all(sim_finished(e) for e in engines):  # published everything, now idle
        assert time.monotonic() < deadline, "the engines did not finish"
        await asyncio.sleep(0.05)  # polling interval, not synchronization
    configs = [
        sim_collector_config(e, worker_id=e.cfg.worker_id, collector_id=f"c-{e.cfg.worker_id}")
        for e in engines
    ]
    started = time.monotonic()
    emb = await start_embedded(configs, None)
    try:
        pending = {(e.cfg.worker_id, r): e for e in engines for r in (0, 1)}
        while pending:
            for (wid, r), e in list(pending.items()):
                col = next(c for c in emb.collectors if c.info.collector_id == f"c-{wid}")
                if await resident(col, wid, r) == truth_resident(truth_instance(e.truth(), r)):
                    del pending[(wid, r)]
            assert time.monotonic() - started <= 5.0, f"not exact within 5 s: {sorted(pending)}"
            await asyncio.sleep(0.05)  # polling interval, not synchronization
    finally:
        await emb.close()
