"""`kvobserve tap --dynamo URL` decodes Dynamo envelopes from a real nats-server or a ZMQ direct
publisher of the simulator: one JSON line per event batch (one RouterEvent), with its envelope."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvobserve.simulate import SimConfig
from kvobserve.simulate.group import SimulatorGroup
from tests.integration.conftest import NatsServer
from tests.integration.fleet_helpers import ROOT, clean_env

pytestmark = pytest.mark.integration


def _group(plane: str, url: str | None = None) -> SimulatorGroup:
    cfg = SimConfig(
        worker_id="t", format="vllm-0.33", dp_size=2, event_plane=plane, event_plane_url=url,
        rate=100.0, http_port=None, replay_port=None, prompts=40,
    )  # fmt: skip
    return SimulatorGroup([cfg]).start()


def _tap(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvobserve", "tap", *args],
        capture_output=True, text=True, timeout=60, env=clean_env(), cwd=ROOT,
    )  # fmt: skip


def _check_lines(out: str, worker_id: int, n: int) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in out.splitlines()]
    assert len(lines) == n
    last: dict[int, int] = {}
    for x in lines:
        assert x["topic"] == "kv-events" and x["worker_id"] == worker_id
        assert x["seq"] == x["event_id"] - 1 and x["storage_tier"] == "device"
        assert x["events"] and {e["type"] for e in x["events"]} <= {"BlockStored", "BlockRemoved"}
        assert all(isinstance(h, int) for e in x["events"] for h in e["block_hashes"])
        assert isinstance(x["publisher_id"], int) and isinstance(x["sequence"], int)
        rank = x["dp_rank"]
        if rank in last:  # each rank's events in order, none skipped
            assert x["event_id"] == last[rank] + 1
        last[rank] = x["event_id"]
    return lines


@pytest.fixture
def nats(tmp_path: Path) -> Iterator[NatsServer]:
    srv = NatsServer(tmp_path / "js", jetstream=False)
    srv.start()
    yield srv
    srv.stop()


def test_tap_nats_subject(nats: NatsServer) -> None:
    group = _group("nats", nats.url)
    try:
        res = _tap("--dynamo", nats.url, "--namespace", "dynamo", "--count", "6", "--timeout", "20")
        assert res.returncode == 0, res.stderr
        lines = _check_lines(res.stdout, group.dynamo[0].worker_id, 6)
        subj = "namespace.dynamo.component.backend.endpoint.generate.kv-events"
        assert {x["subject"] for x in lines} == {subj}
        # another namespace sees nothing: --timeout ends it, --count not reached is exit 1
        res = _tap("--dynamo", nats.url, "--namespace", "other", "--count", "1", "--timeout", "1")
        assert (res.returncode, res.stdout) == (1, "")
    finally:
        group.stop()


def test_tap_zmq_direct_endpoint() -> None:
    group = _group("zmq")
    try:
        ep = next(e.url for e in group.endpoints() if e.kind == "dynamo_kv" and e.dp_rank == 1)
        res = _tap("--dynamo", ep, "--count", "5", "--timeout", "20")
        assert res.returncode == 0, res.stderr
        lines = _check_lines(res.stdout, group.dynamo[0].worker_id, 5)
        assert {x["dp_rank"] for x in lines} == {1} and {x["endpoint"] for x in lines} == {ep}
        metrics = next(e.url for e in group.endpoints() if e.kind == "dynamo_metrics")
        res = _tap("--dynamo", metrics, "--all-topics", "--count", "4", "--timeout", "20")
        assert res.returncode == 0, res.stderr
        loads = [json.loads(x) for x in res.stdout.splitlines()]
        assert {x["topic"] for x in loads} <= {"kv_metrics", "forward-pass-metrics"}
        assert all(x["load"]["dp_rank"] in (0, 1) for x in loads)
    finally:
        group.stop()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dynamo", "http://h:1"], "bad --dynamo 'http://h:1'"),
        (["--dynamo", "tcp://127.0.0.1:1", "--namespace", "x"], "are for NATS"),
        (["--dynamo", "nats://127.0.0.1:1", "tcp://127.0.0.1:2"], "takes no ENDPOINT"),
    ],
)
def test_tap_dynamo_usage_errors(args: list[str], message: str) -> None:
    res = _tap(*args)
    assert res.returncode == 2 and message in res.stderr, res.stderr
