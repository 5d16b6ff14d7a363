"""A lost collector pages once: the shipped alerts/alertmanager.yml, in a real Alertmanager.

Issue 21 ("no storms"): losing one collector raised KVObserveCollectorDown, a KVEventStreamDown
per stream and a DPRankUncovered per rank of its node, and the example config muted only the
stream-down alerts. Here the alerts of such a loss, with the labels the rules give them
(alerts/tests/*_test.yml pins those), are posted to a running Alertmanager with the shipped
config, and `inhibitedBy` is read back from /api/v2/alerts.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvobserve.simulate.ports import free_port
from tests.integration.stack_helpers import Stack, http_json
from tests.polling import until

pytestmark = pytest.mark.integration

AGGREGATOR = "127.0.0.1:9477"  # the `instance` of the aggregator that Prometheus scrapes


def _placeholder_receivers(path: Path, text: str) -> str:
    """The example's webhook receivers: a port where nothing listens (notifications fail)."""
    if path.name != "alertmanager.yml":
        return text
    return re.sub(r"http://127\.0\.0\.1:\d+", f"http://127.0.0.1:{free_port()}", text)


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[str]:
    """The compose file's Alertmanager (Debian's prometheus-alertmanager) with the shipped
    alerts/alertmanager.yml, on 127.0.0.1 and a free port."""
    stack = Stack(tmp_path, edit=_placeholder_receivers)
    try:
        stack.start("alertmanager")
        ready = stack.url("alertmanager", 9093, "/-/ready")
        stack.until(lambda: _ok(ready), 20, "alertmanager ready")
        yield stack.url("alertmanager", 9093)
    finally:
        stack.stop()


def _ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return bool(resp.status == 200)


def _alert(name: str, instance: str = AGGREGATOR, **labels: str) -> dict[str, Any]:
    """A critical alert as Prometheus sends it (job and instance of the scraped aggregator)."""
    now = dt.datetime.now(dt.UTC)
    base = {"alertname": name, "severity": "critical", "job": "kvobserve", "instance": instance}
    return {
        "labels": {**base, **labels},
        "annotations": {"summary": name},
        "startsAt": now.isoformat(),
        "endsAt": (now + dt.timedelta(hours=1)).isoformat(),
    }


def _post(base: str, alerts: list[dict[str, Any]]) -> None:
    req = urllib.request.Request(
        f"{base}/api/v2/alerts",
        data=json.dumps(alerts).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200


def _key(a: dict[str, Any]) -> tuple[str, str, str, str]:
    lb = a["labels"]
    return (
        lb["alertname"],
        lb.get("instance", ""),
        lb.get("collector", "-"),
        lb.get("dp_rank", "-"),
    )


def test_a_lost_collector_pages_once_and_mutes_nothing_of_other_nodes(alertmanager: str) -> None:
    """node-1 of a two-node sglang-dp8 is lost: its collector alert pages, its four streams'
    KVEventStreamDown and its four ranks' DPRankUncovered are inhibited by it; node-0's stream,
    a rank nobody ever owned and a same-named collector of another aggregator are not."""
    lost = _alert("KVObserveCollectorDown", collector="node-1", node_rank="1", hostname="gpu-1")
    alerts = [lost]
    for r in range(4, 8):
        alerts.append(_alert("KVEventStreamDown", worker_id="sglang-dp8", node_rank="1",
                             dp_rank=str(r), collector="node-1",
                             endpoint=f"tcp://127.0.0.2:{5557 + r}"))  # fmt: skip
        alerts.append(_alert("DPRankUncovered", worker_id="sglang-dp8", dp_rank=str(r),
                             collector="node-1", node_rank="1"))  # fmt: skip
    others = [
        _alert("KVEventStreamDown", worker_id="sglang-dp8", node_rank="0", dp_rank="2",
               collector="node-0", endpoint="tcp://127.0.0.1:5559"),
        _alert("DPRankUncovered", worker_id="vllm-dp2", dp_rank="1"),  # never owned: no owner
        # another fleet's aggregator, whose collector happens to be called node-1 as well
        _alert("KVEventStreamDown", "127.0.0.9:9477", worker_id="other", node_rank="1",
               dp_rank="0", collector="node-1", endpoint="tcp://127.0.0.3:5557"),
    ]  # fmt: skip
    _post(alertmanager, alerts + others)

    def settled() -> list[dict[str, Any]] | None:
        got: list[dict[str, Any]] = http_json(f"{alertmanager}/api/v2/alerts")
        if len(got) < len(alerts) + len(others):
            return None
        # the inhibitor has taken in the source (its state is worked out at each request)
        return got if any(a["status"]["inhibitedBy"] for a in got) else None

    got = until(
        settled,
        20,
        "every alert received and the inhibition applied",
        retry_on=(OSError, ValueError),
    )
    by_key = {_key(a): a for a in got}
    source = by_key[("KVObserveCollectorDown", AGGREGATOR, "node-1", "-")]
    assert (source["status"]["state"], source["status"]["inhibitedBy"]) == ("active", [])
    muted = {k for k, a in by_key.items() if a["status"]["inhibitedBy"]}
    assert muted == {
        (name, AGGREGATOR, "node-1", str(r))
        for name in ("KVEventStreamDown", "DPRankUncovered")
        for r in range(4, 8)
    }
    for k in muted:
        assert by_key[k]["status"]["inhibitedBy"] == [source["fingerprint"]], k
        assert by_key[k]["status"]["state"] == "suppressed", k
    # what still pages: the lost collector once, and what has another cause
    paging = {k for k, a in by_key.items() if a["status"]["state"] == "active"}
    assert paging == {
        ("KVObserveCollectorDown", AGGREGATOR, "node-1", "-"),
        ("KVEventStreamDown", AGGREGATOR, "node-0", "2"),
        ("DPRankUncovered", AGGREGATOR, "-", "1"),
        ("KVEventStreamDown", "127.0.0.9:9477", "node-1", "0"),
    }


@pytest.mark.parametrize(
    ("name", "state"),
    [("KVWorkerLayoutMismatch", "layout_mismatch"), ("KVWorkerUndiscovered", "undiscovered")],
)
def test_a_worker_a_collector_cannot_watch_pages_once(
    alertmanager: str, name: str, state: str
) -> None:
    """Issue 21, seen 4: `run` with nnodes = 1 on a 2-node engine leaves ranks 4-7 uncovered.
    The worker's own alert pages; those ranks' DPRankUncovered are inhibited by it, and another
    worker's uncovered rank and the same worker id of another aggregator are not."""
    worker = _alert(name, worker_id="sglang-dp8", node_rank="0", collector="box", state=state)
    ranks = [_alert("DPRankUncovered", worker_id="sglang-dp8", dp_rank=str(r)) for r in range(4, 8)]
    others = [
        _alert("DPRankUncovered", worker_id="vllm-dp2", dp_rank="1"),
        _alert("DPRankUncovered", "127.0.0.9:9477", worker_id="sglang-dp8", dp_rank="4"),
    ]
    _post(alertmanager, [worker, *ranks, *others])

    def settled() -> list[dict[str, Any]] | None:
        got: list[dict[str, Any]] = http_json(f"{alertmanager}/api/v2/alerts")
        if len(got) < 1 + len(ranks) + len(others):
            return None
        return got if any(a["status"]["inhibitedBy"] for a in got) else None

    got = until(
        settled,
        20,
        "every alert received and the inhibition applied",
        retry_on=(OSError, ValueError),
    )
    source = next(a for a in got if a["labels"]["alertname"] == name)
    assert (source["status"]["state"], source["status"]["inhibitedBy"]) == ("active", [])
    muted = {
        (a["labels"]["instance"], a["labels"]["worker_id"], a["labels"]["dp_rank"])
        for a in got
        if a["status"]["inhibitedBy"] == [source["fingerprint"]]
        and a["status"]["state"] == "suppressed"
    }
    assert muted == {(AGGREGATOR, "sglang-dp8", str(r)) for r in range(4, 8)}
    paging = {_key(a) for a in got if a["status"]["state"] == "active"}
    assert paging == {
        (name, AGGREGATOR, "box", "-"),
        ("DPRankUncovered", AGGREGATOR, "-", "1"),
        ("DPRankUncovered", "127.0.0.9:9477", "-", "4"),
    }
