"""The demo's usage over ten minutes' worth of batches, seen by a real Prometheus with the shipped rules.

The simulator's scheduler usage depends only on how many batches a rank has published, not on
time, so the demo's workload runs at SPEEDUP times its rate (no faults: the clean profile) until
every rank has published ten minutes of batches at the demo rate. Prometheus (Debian's) scrapes
the demo every second from before the first batch and evaluates alerts/kvobserve-rules.yml with
every `for:` divided by SPEEDUP, so KVCacheNearFull's 10 minutes are the run's 60 s. The sampled
maximum is checked against 0.9, and so is the exact per-batch maximum, replayed offline.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvobserve.commands.demo import Demo, start_demo
from kvobserve.config import HttpConfig
from kvobserve.simulate import FaultConfig
from kvobserve.simulate.cache import PromptLibrary
from kvobserve.simulate.ports import free_port
from kvobserve.simulate.stream import SimStream
from kvobserve.simulate.worker import SimulatedWorker
from tests.integration.stack_helpers import ROOT, scale_for
from tests.polling import until_async

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
NOT_UP = (OSError, ValueError, LookupError)  # not up yet, or no data yet

DEMO_RATE = 20.0  # `kvobserve demo`'s default batches/s per rank
SPEEDUP = 10.0
BATCHES = int(DEMO_RATE * 600)  # ten minutes at the demo's rate: 12,000 per rank
RULES = ROOT / "alerts" / "kvobserve-rules.yml"
LIMIT = 0.9


def _get(base: str, path: str, **params: str) -> Any:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}" if params else f"{base}{path}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def _query(base: str, promql: str) -> list[dict[str, Any]]:
    doc = _get(base, "/api/v1/query", query=promql)
    assert doc["status"] == "success", doc
    result: list[dict[str, Any]] = doc["data"]["result"]
    return result


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A Prometheus scraping 127.0.0.1:<demo port> every second; (its URL, the demo port)."""
    binary = shutil.which("prometheus")
    assert binary is not None, "prometheus not on PATH: run scripts/install-tools.sh"
    demo_port, port = free_port(), free_port()
    (tmp_path / "rules.yml").write_text(scale_for(RULES.read_text(), SPEEDUP))
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s, scrape_timeout: 1s}\n"
        f"rule_files: ['{tmp_path / 'rules.yml'}']\n"
        "scrape_configs:\n"
        "  - job_name: kvobserve\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{demo_port}']}}]\n"
    )
    with (tmp_path / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen(
            [
                binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}", demo_port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _ranks(demo: Demo) -> list[tuple[SimulatedWorker, int, int]]:
    """(node, rank, batches the rank's only publisher has sent so far)."""
    return [(w, st.rank, st.streams[0].seq) for w in demo.sims for st in w.ranks]


def _exact_max(w: SimulatedWorker, rank: int, batches: int) -> float:
    """The rank's usage after every one of its batches, replayed offline: the maximum."""
    c, fmt = w.cfg, w.fmt
    lib = PromptLibrary(c.seed, fmt.hash_kind, c.page_size, c.prompts, c.prefixes, c.zipf_s)
    seed = zlib.crc32(f"{c.seed}/{c.worker_id}/{rank}.0".encode())  # as SimulatedWorker seeds it
    s = SimStream(
        fmt, f"{rank}.0", "primary", rank, rank, c.topic.encode(), lib, seed, c.capacity_tokens,
        c.page_size, c.buffer_steps, c.faults, c.requests_per_batch, c.output_tokens,
        c.flush_every, c.max_running_requests,
    )  # fmt: skip
    top = 0
    for i in range(batches):
        s.next_batch(float(i))
        top = max(top, s.held_tokens)
    assert s.held_tokens == w.rank(rank).streams[0].held_tokens, "the replay is the same run"
    return top / c.capacity_tokens


async def test_clean_demo_usage_stays_below_0_9_for_ten_minutes_of_batches(
    prometheus: tuple[str, int],
) -> None:
    prom, demo_port = prometheus

    def ready() -> bool:
        return bool(urllib.request.urlopen(f"{prom}/-/ready").status == 200)

    await until_async(lambda: asyncio.to_thread(ready), 30, "Prometheus ready", retry_on=NOT_UP)

    def target_known() -> bool:  # from here on every scrape and evaluation is in the TSDB
        return bool(_get(prom, "/api/v1/targets")["data"]["activeTargets"])

    await until_async(
        lambda: asyncio.to_thread(target_known),
        30,
        "Prometheus knows the demo target",
        retry_on=NOT_UP,
    )
    clean = FaultConfig()
    demo = await start_demo(
        HttpConfig(listen=f"127.0.0.1:{demo_port}"), rate=DEMO_RATE * SPEEDUP, interval_s=0.5,
        sglang_faults=clean, vllm_faults=clean,
    )  # fmt: skip
    t0 = time.monotonic()
    try:
        # CPU-bound: slower on a busy machine, so the deadline is on progress (the slowest
        # rank's batches); the test's timeout bounds the whole
        await until_async(
            lambda: all(n >= BATCHES for _, _, n in _ranks(demo)),
            30,
            f"{BATCHES} batches on every rank",
            progress=lambda: min(n for _, _, n in _ranks(demo)),
        )
        ran = time.monotonic() - t0
        window = f"{int(ran) + 30}s"
        last_batch = time.time()

        def scraped_after() -> bool:  # two more scrapes (1 s apart) after the last batch
            got = _query(prom, "max(timestamp(kvobserve_scheduler_token_usage_ratio))")
            return bool(got) and float(got[0]["value"][1]) >= last_batch + 1.0

        await until_async(
            lambda: asyncio.to_thread(scraped_after), 30, "two scrapes after the last batch",
            retry_on=NOT_UP,
        )  # fmt: skip
        seen = await asyncio.to_thread(
            _query, prom, f"count_over_time(kvobserve_scheduler_token_usage_ratio[{window}])"
        )
        peaks = await asyncio.to_thread(
            _query, prom, f"max_over_time(kvobserve_scheduler_token_usage_ratio[{window}])"
        )
        alerts = await asyncio.to_thread(
            _query, prom, f'count_over_time(ALERTS{{alertname="KVCacheNearFull"}}[{window}])'
        )
        usage = await asyncio.to_thread(
            _query, prom, f"count_over_time(kvobserve_kv_cache_usage_ratio[{window}])"
        )
        rules = await asyncio.to_thread(_get, prom, "/api/v1/rules")
    finally:
        await demo.close()
    done = _ranks(demo)  # stopped: the counts no longer move

    assert len(peaks) == 12 and len(seen) == 12 and len(usage) == 12, "every stream, both gauges"
    assert all(float(x["value"][1]) >= 0.8 * ran for x in seen), ("scraped through the run", seen)
    assert all(float(x["value"][1]) >= 0.8 * ran for x in usage), ("usage ratio throughout", usage)
    top = max(float(x["value"][1]) for x in peaks)
    print(f"\nran {ran:.1f} s; max kvobserve_scheduler_token_usage_ratio sampled: {top:.4f}")
    assert 0 < top < LIMIT
    assert alerts == [], "KVCacheNearFull was never pending or firing"
    (near_full,) = [
        r for g in rules["data"]["groups"] for r in g["rules"] if r["name"] == "KVCacheNearFull"
    ]
    assert near_full["health"] == "ok" and near_full["state"] == "inactive"
    assert near_full["duration"] == 600 / SPEEDUP  # 10m, scaled

    exact = max(_exact_max(w, rank, n) for w, rank, n in done)
    print(f"exact per-batch max over {min(n for *_, n in done)}+ batches per rank: {exact:.4f}")
    assert top <= exact < LIMIT
