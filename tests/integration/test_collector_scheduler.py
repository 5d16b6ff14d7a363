"""Acceptance: the leader's scheduler stats match what the engine serves (usage as it counts it)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvobserve.analysis.fleet import FleetState
from kvobserve.simulate import SimulatedWorker
from kvobserve.wire.snapshot import Snapshot
from tests.integration.collector_helpers import (
    Sims,
    all_streams,
    running_collector,
    sim_collector_config,
    sim_config,
    sim_finished,
    truth_instance,
    wait_connected,
    wait_snapshot,
)

pytestmark = pytest.mark.integration
# engine sample name -> SchedulerStats field, written out here rather than taken from kvobserve
NAMES = {
    "sglang:num_running_reqs": "running_requests",
    "sglang:num_queue_reqs": "queued_requests",
    "sglang:token_usage": "token_usage_ratio",
    "sglang:cache_hit_rate": "cache_hit_ratio",
    "sglang:max_total_num_tokens": "max_total_tokens",
    "vllm:num_requests_running": "running_requests",
    "vllm:num_requests_waiting": "queued_requests",
    "vllm:kv_cache_usage_perc": "token_usage_ratio",
    "vllm:gpu_cache_usage_perc": "token_usage_ratio",
}


async def scrape_engine(sim: SimulatedWorker) -> dict[int, dict[str, float]]:
    """The engine's /metrics now, as SchedulerStats fields per DP rank."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{sim.http_port}/metrics") as resp,
    ):
        assert resp.status == 200
        text = await resp.text()
    rank_label = "dp_rank" if sim.fmt.engine == "sglang" else "engine"
    out: dict[int, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if rank_label not in s.labels:
                continue  # not per rank: SGLang's tokenizer counters (prompt_tokens_total, ...)
            vals = out.setdefault(int(s.labels[rank_label]), {})
            if s.name in NAMES:
                vals[NAMES[s.name]] = s.value
            elif s.name == "vllm:cache_config_info":
                vals["max_total_tokens"] = int(s.labels["num_gpu_blocks"]) * int(
                    s.labels["block_size"]
                )
    return out


def fresh(since: float, source: str, ranks: int) -> Callable[[Snapshot], bool]:
    """A snapshot predicate: every rank has scheduler stats from `source` updated after `since`."""

    def pred(snap: Snapshot) -> bool:
        got = [s for s in snap.scheduler if s.source == source and s.updated > since]
        return sorted(s.dp_rank for s in got) == list(range(ranks))

    return pred


@pytest.mark.parametrize(
    ("fmt", "source"),
    [
        ("sglang-0.5.23", "metrics"),
        ("sglang-0.5.23", "load"),
        ("vllm-0.33", "metrics"),
        ("vllm-0.10", "metrics"),
    ],
)
async def test_scheduler_stats_match_the_engine(fmt: str, source: str, sims: Sims) -> None:
    load = 0 if source == "load" else None
    sim = sims.start(sim_config(fmt, http_port=0, load_port=load, side_interval_s=0.1), held=True)
    extra: dict[str, Any] = (
        {"load_endpoint": f"tcp://127.0.0.1:{sim.load_base}"}
        if source == "load"
        else {"metrics_url": f"http://127.0.0.1:{sim.http_port}/metrics"}
    )
    async with running_collector(sim_collector_config(sim, interval_s=0.1, **extra)) as col:
        await wait_connected(col, sim)
        await wait_snapshot(col, all_streams(lambda s: s.batches_total == 60), what="batches")
        assert sim_finished(sim)  # the engine is idle: its scheduler values stay put
        served = await scrape_engine(sim)
        since = time.time()
        snap = await wait_snapshot(col, fresh(since, source, 2), what=f"{source} after our scrape")
        truth = sim.truth()
        fleet = FleetState()
        fleet.update(snap, snap.time)
        view = fleet.view(snap.time)
        for r in (0, 1):
            (st,) = [s for s in snap.scheduler if s.dp_rank == r]
            want = dict(served[r])
            if source == "load":  # LoadStat has no hit rate
                want.pop("cache_hit_ratio", None)
            got = {k: getattr(st, k) for k in want}
            assert got == want
            assert set(want) >= {
                "running_requests",
                "queued_requests",
                "token_usage_ratio",
                "max_total_tokens",
            }
            assert st.max_total_tokens == sim.cfg.capacity_tokens
            (sv,) = [v for v in view.streams if v.stats.dp_rank == r]
            gpu_tokens = truth_instance(truth, r)["resident_tokens"]["GPU"]
            assert gpu_tokens > 0
            assert sv.gpu_tokens == gpu_tokens
            assert sv.usage_ratio == gpu_tokens / st.max_total_tokens
            # the engine's own usage leaves evictable cached pages out, as SGLang and vLLM do:
            # tokens held by running requests / capacity, below the resident share
            held = truth_instance(truth, r)["held_tokens"]
            assert st.token_usage_ratio == held / st.max_total_tokens < sv.usage_ratio
