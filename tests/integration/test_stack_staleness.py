"""The staleness rule on a real Prometheus with the shipped rules (the docker-compose stack).

Issue 21: node 1's engine killed, its collector left running, kept serving rank 1's last cache
values, so a dashboard showed a dead rank as busy and KVCacheNearFull could keep firing on it.
Here the engine of node 1 is killed in the `clean` stack (tests/integration/test_stack.py runs
the same topology): within two scrape intervals rank 1's gauges are absent from Prometheus
while its counters and `kvobserve_stream_up 0` stay, KVEventStreamDown fires for it (its `for:`
shortened as in test_stack.py) and no other alert is even pending.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.integration.stack_helpers import http_json
from tests.integration.test_stack import (  # noqa: F401 (stack_factory: a fixture)
    FOR_FACTOR,
    WORKER,
    _am_alerts,
    _query,
    _rule_alerts,
    stack_factory,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

SCRAPE_S = 1.0  # the test copy of deploy/prometheus.yml scrapes every 1 s (test_stack._edit)
# The gauges of a stream's cache in this topology; counters and health that must stay.
GAUGES = (
    "kvobserve_kv_blocks",
    "kvobserve_kv_tokens",
    "kvobserve_kv_capacity_tokens",
    "kvobserve_kv_cache_usage_ratio",
    "kvobserve_kv_state_complete",
    "kvobserve_kv_duplicate_stream",
    "kvobserve_kv_event_lag_seconds",
)
KEPT = (
    "kvobserve_stream_up",
    "kvobserve_stream_info",
    "kvobserve_kv_event_batches_total",
    "kvobserve_kv_last_batch_timestamp_seconds",
)


def _ranks(stack: Any, metric: str) -> set[str]:
    return {r["metric"]["dp_rank"] for r in _query(stack, f'{metric}{{worker_id="{WORKER}"}}')}


def _last_sample(stack: Any, metric: str, rank: str) -> float:
    """The timestamp of the newest raw sample of the series (0: none in the last 2 minutes)."""
    doc = http_json(
        stack.url("prometheus", 9090, "/api/v1/query"),
        {"query": f'{metric}{{worker_id="{WORKER}", dp_rank="{rank}"}}[2m]'},
    )
    return max((float(t) for r in doc["data"]["result"] for t, _ in r["values"]), default=0.0)


def test_a_killed_engine_leaves_no_gauges_and_pages_as_stream_down(stack_factory: Any) -> None:  # noqa: F811
    stack, t0 = stack_factory("clean")

    def warm() -> bool:  # both ranks publish, Prometheus holds their gauges, nothing raised
        # (the streams were down until the engines started: their pending alerts clear)
        return all(_ranks(stack, m) == {"0", "1"} for m in GAUGES) and not _rule_alerts(stack)

    stack.until(
        warm, t0 + 30 - time.monotonic(), "both ranks' gauges in Prometheus and no alert pending"
    )

    engine = stack.procs["engine-node-1"]
    killed = time.time()
    engine.kill()  # SIGKILL by PID: the engine dies, its collector runs on
    engine.wait(timeout=10)
    del stack.procs["engine-node-1"]  # exited on purpose: not a failure of the stack

    def gone() -> bool:
        return all(_ranks(stack, m) == {"0"} for m in GAUGES)

    stack.until(gone, killed + 15 - time.monotonic(), "rank 1's gauges absent")
    # Prometheus's own record: the last scrape that still carried rank 1's gauges came at most
    # one scrape interval after the kill (plus 0.5 s of jitter on a loaded machine), so the first
    # scrape without them came within two (a collector snapshot, then a scrape)
    late = {m: round(_last_sample(stack, m, "1") - killed, 3) for m in GAUGES}
    print(f"last scrape with rank 1's gauges, s after the kill: {late}")
    assert all(-2 * SCRAPE_S < d <= SCRAPE_S + 0.5 for d in late.values()), late
    # ... while rank 1's counters and health stay, and rank 0 is untouched
    for m in KEPT:
        assert _ranks(stack, m) == {"0", "1"}, m
    down = _query(stack, f'kvobserve_stream_up{{worker_id="{WORKER}", dp_rank="1"}}')
    assert [r["value"][1] for r in down] == ["0"], down

    want = {("KVEventStreamDown", "1", "1")}

    def paged() -> set[tuple[str, str, str]]:
        got = {
            (a["labels"]["alertname"], a["labels"].get("node_rank"), a["labels"].get("dp_rank"))
            for a in _am_alerts(stack)
        }
        return got if want <= got else set()

    for_s = 5 * 60 / FOR_FACTOR  # KVEventStreamDown's `for: 5m`, shortened
    got = stack.until(
        paged,
        killed + for_s + 20 - time.monotonic(),
        "KVEventStreamDown for rank 1 in Alertmanager",
    )
    assert got == want, f"other alerts: {sorted(got - want)}"
    # nothing else even pending in Prometheus: no usage, no index, no stall on a dead rank
    raised = {(a["labels"]["alertname"], a["labels"].get("dp_rank")) for a in _rule_alerts(stack)}
    assert raised == {("KVEventStreamDown", "1")}, raised
