"""What more memory would buy a pool, live: the trace on 4 ranks over two loopback nodes, two
`kvobserve collect` processes and `kvobserve aggregate` over a real nats-server.

The simulator replays the trace fixture's first 10 minutes at 10x on 4 ranks of 800 pages of
512 tokens (one page per trace block), node 0 (ranks 0-1) on 127.0.0.1 and node 1 (ranks 2-3)
on 127.0.0.2; each node's collector watches its own ranks, so the pool's global ghost list is
merged across collectors from the miss split's sampled deltas (the default sample). Once every
batch is applied and the merge has passed the last one, `/api/v1/capacity`'s pool curve at 1, 2
and 4 x the pool's memory is held to the simulator's own replay of one cache that large
(`--truth-capacities`), with random and KV-aware routing. The ranks' capacity is the engines'
(the leader's scrape of the simulator's /metrics), not configured.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks._common import free_port, stop_process
from tests.integration.conftest import NatsServer
from tests.integration.trace_fleet import (
    HOSTS,
    POOL,
    ROOT,
    collector_toml,
    endpoints,
    get,
    read_truth,
    spawn,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

FIXTURE = ROOT / "tests" / "fixtures" / "traces" / "mooncake-conversation.jsonl.gz"
PAGE, PAGES = 512, 800  # per rank
FACTORS = ("1", "2", "4")
TARGET = 0.01  # within 1 point of one cache of that size (docs/cache-analytics.md)


def _replay(tmp: Path, route: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, float]]:
    """One replay: (the pool's /api/v1/capacity document, the simulator's truth, its
    kvobserve_pool_kv_hit_ratio_at_capacity by factor); processes stopped by PID in finally."""
    tmp.mkdir()
    truth_path = tmp / "truth.json"
    procs: list[subprocess.Popen[bytes]] = []
    nats = NatsServer(tmp / "js", jetstream=False)
    nats.start()
    try:
        sim_log = tmp / "sim.log"
        procs.append(spawn(
            ["simulate", "--trace", str(FIXTURE), "--trace-seconds", "600", "--speed", "10",
             "--route", route, "--dp-size", "4", "--nnodes", "2", "--all-nodes", "--node-hosts",
             ",".join(HOSTS), "--capacity-tokens", str(PAGE * PAGES), "--page-size", str(PAGE),
             "--start-delay", "20", "--no-replay", "--worker-id", POOL, "--truth",
             str(truth_path), "--truth-interval", "1", "--truth-capacities", ",".join(FACTORS)],
            sim_log,
        ))  # fmt: skip
        eps = endpoints(sim_log, time.monotonic() + 30)
        port = free_port()
        procs.append(spawn(["aggregate", "--nats", nats.url, "--listen", f"127.0.0.1:{port}",
                             "--cluster", "t"], tmp / "agg.log"))  # fmt: skip
        for node in (0, 1):
            cfg = collector_toml(tmp / f"node-{node}.toml", node, eps["kv0"], eps["http"],
                                  nats.url)  # fmt: skip
            procs.append(spawn(["collect", "-c", str(cfg)], tmp / f"node-{node}.log"))
        api = f"http://127.0.0.1:{port}"
        end = (
            time.monotonic() + 300
        )  # the start, the replay (60 s), the truths, on a loaded machine
        caught_up = None
        while True:
            assert time.monotonic() < end, (tmp / "agg.log").read_text()[-3000:]
            time.sleep(0.5)  # polling the truth file and the aggregator, with a deadline
            doc = read_truth(truth_path)
            replay = (doc or {}).get("replays", [{}])[0]
            if not (replay.get("done") and replay.get("pending_events") == 0):
                continue
            if "capacities" not in replay:
                continue  # the simulator's one-cache replays, once the trace is done
            try:
                streams = get(f"{api}/api/v1/streams")
                misses = get(f"{api}/api/v1/misses")["pools"]
                pools = get(f"{api}/api/v1/capacity")["pools"]
            except OSError:
                continue
            sent = {
                int(r): rank["instances"][-1]["batches"]
                for w in (doc or {})["workers"]
                for r, rank in w["ranks"].items()
            }
            if {s["dp_rank"]: s["batches"] for s in streams} != sent:
                continue
            caught_up = caught_up or time.time()
            # the merge applies every collector's changes up to the earliest `until` it has;
            # a snapshot dropped under load costs a delta, asked again in full within 10 s
            if misses and (misses[0]["as_of"] or 0) > caught_up and pools and pools[0]["trusted"]:
                break
        served: dict[str, float] = {}
        for fam in text_string_to_metric_families(get(f"{api}/metrics")):
            for s in fam.samples:
                if s.name == "kvobserve_pool_kv_hit_ratio_at_capacity":
                    served[s.labels["factor"]] = s.value
        truth = read_truth(truth_path)
        assert truth is not None
        return pools[0], truth["replays"][0], served
    finally:
        for p in reversed(procs):
            stop_process(p)
        nats.stop()


@pytest.mark.parametrize("route", ["random", "kv_aware"])
def test_a_pools_global_curve_over_nats_equals_one_cache_of_its_memory(
    tmp_path: Path, route: str
) -> None:
    pool, truth, served = _replay(tmp_path / route, route)
    assert pool["pool"] == POOL and pool["routing"] == "global", pool
    assert pool["trusted"], pool["reason"]
    # the engines' own capacity (the leader's scrape), or where a rank's is not in the view, the
    # most its top tier held (its curve's basis): within a page of it
    assert abs(pool["capacity_tokens"] - 4 * PAGE * PAGES) <= 4 * PAGE, pool["capacity_tokens"]
    got = {p["factor"]: p for p in pool["points"]}
    for f in FACTORS:
        want = truth["capacities"][f]["hit_rate"]
        assert abs(got[f]["hit_rate"] - want) <= TARGET, (route, f, got[f], want)
        # trusted, unless a resync under load restarted its evictions: then it says so
        assert got[f]["trusted"] == (got[f]["evicted"] >= got[f]["needs"]), got[f]
    # /metrics serves the default points of the same curve, while they are trusted
    trusted = {f: got[f]["hit_rate"] for f in ("1", "2") if got[f]["trusted"]}
    assert served == pytest.approx(trusted, abs=1e-4)
    # per worker and rank: the routing that was observed, never the pool's what-if
    assert [w["routing"] for w in pool["workers"]] == ["observed"]
    assert sorted(r["dp_rank"] for r in pool["ranks"]) == [0, 1, 2, 3]
    assert {r["routing"] for r in pool["ranks"]} == {"observed"}
