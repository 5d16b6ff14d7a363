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

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks._common import free_port, stop_process
from tests.integration.conftest import NatsServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "traces" / "mooncake-conversation.jsonl.gz"
HOSTS = ("127.0.0.1", "127.0.0.2")
POOL = "trace"
PAGE, PAGES = 512, 800  # per rank
FACTORS = ("1", "2", "4")
TARGET = 0.01  # within 1 point of one cache of that size (docs/cache-analytics.md)


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "kvobserve", *argv], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT
        )


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = resp.read().decode()
    return json.loads(body) if "/api/" in url else body


def _truth(path: Path) -> dict[str, Any] | None:
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc


def _endpoints(log: Path, deadline: float) -> dict[str, str]:
    """kind (kv0 .. kv3, http) -> url, from the simulator's `endpoint` lines."""
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if "ready" in text:
            out = {}
            for line in text.splitlines():
                if line.startswith("endpoint "):
                    f = dict(p.split("=", 1) for p in line.split()[1:])
                    out[f["kind"] + (f["dp_rank"] if f["kind"] == "kv" else "")] = f["url"]
            return out
        time.sleep(0.1)  # polling the simulator's output for its endpoints, with a deadline
    raise TimeoutError(f"the simulator did not start: {log.read_text()}")


def _collector_toml(path: Path, node: int, kv: str, http: str, nats_url: str) -> Path:
    port = kv.rsplit(":", 1)[1]
    path.write_text(
        f'cluster = "t"\n[collector]\nid = "node-{node}"\nnode_rank = {node}\nnnodes = 2\n'
        f'interval_s = 1.0\nhost = "{HOSTS[node]}"\n[http]\nlisten = ""\n'
        f'[nats]\nurl = "{nats_url}"\n'
        f'[[worker]]\nid = "{POOL}"\nengine = "sglang"\ndp_size = 4\ndp_attention = true\n'
        f'kv_endpoint = "tcp://*:{port}"\nprobe_extra_ports = 0\nmetrics_url = "{http}/metrics"\n'
    )
    return path


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
        procs.append(_spawn(
            ["simulate", "--trace", str(FIXTURE), "--trace-seconds", "600", "--speed", "10",
             "--route", route, "--dp-size", "4", "--nnodes", "2", "--all-nodes", "--node-hosts",
             ",".join(HOSTS), "--capacity-tokens", str(PAGE * PAGES), "--page-size", str(PAGE),
             "--start-delay", "20", "--no-replay", "--worker-id", POOL, "--truth",
             str(truth_path), "--truth-interval", "1", "--truth-capacities", ",".join(FACTORS)],
            sim_log,
        ))  # fmt: skip
        eps = _endpoints(sim_log, time.monotonic() + 30)
        port = free_port()
        procs.append(_spawn(["aggregate", "--nats", nats.url, "--listen", f"127.0.0.1:{port}",
                             "--cluster", "t"], tmp / "agg.log"))  # fmt: skip
        for node in (0, 1):
            cfg = _collector_toml(tmp / f"node-{node}.toml", node, eps["kv0"], eps["http"],
                                  nats.url)  # fmt: skip
            procs.append(_spawn(["collect", "-c", str(cfg)], tmp / f"node-{node}.log"))
        api = f"http://127.0.0.1:{port}"
        end = (
            time.monotonic() + 300
        )  # the start, the replay (60 s), the truths, on a loaded machine
        caught_up = None
        while True:
            assert time.monotonic() < end, (tmp / "agg.log").read_text()[-3000:]
            time.sleep(0.5)  # polling the truth file and the aggregator, with a deadline
            doc = _truth(truth_path)
            replay = (doc or {}).get("replays", [{}])[0]
            if not (replay.get("done") and replay.get("pending_events") == 0):
                continue
            if "capacities" not in replay:
                continue  # the simulator's one-cache replays, once the trace is done
            try:
                streams = _get(f"{api}/api/v1/streams")
                misses = _get(f"{api}/api/v1/misses")["pools"]
                pools = _get(f"{api}/api/v1/capacity")["pools"]
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
        for fam in text_string_to_metric_families(_get(f"{api}/metrics")):
            for s in fam.samples:
                if s.name == "kvobserve_pool_kv_hit_ratio_at_capacity":
                    served[s.labels["factor"]] = s.value
        truth = _truth(truth_path)
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
