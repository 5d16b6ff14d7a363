"""`kvobserve status` against a live aggregator HTTP server, with auth, and when unreachable."""

from __future__ import annotations

import argparse
import asyncio
import io

import pytest

from kvobserve import __version__
from kvobserve.aggregator import Aggregator
from kvobserve.analysis.fleet import FleetState
from kvobserve.commands import status as statuscmd
from kvobserve.export.server import create_app, serve
from kvobserve.simulate.ports import free_port
from kvobserve.wire.snapshot import (
    CollectorInfo,
    Event,
    Snapshot,
    StreamStats,
    WorkerInfo,
    encode_snapshot,
)
from tests.unit.test_export_fleet import NOW, rich_state

pytestmark = pytest.mark.integration


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    statuscmd.add_arguments(p)
    return p.parse_args(list(argv))


async def _run(args: argparse.Namespace) -> tuple[int, str]:
    out = io.StringIO()
    # urllib blocks: run it off the loop that serves the aggregator.
    rc = await asyncio.to_thread(statuscmd.run, args, out)
    return rc, out.getvalue()


async def test_status_table_and_conditions() -> None:
    state = rich_state()
    srv = await serve(create_app(lambda: state.view(NOW)), "127.0.0.1:0")
    try:
        rc, text = await _run(_args("--url", srv.url + "/"))
    finally:
        await srv.close()
    assert rc == 1  # critical conditions are active (a collector is down, a rank uncovered)
    lines = text.splitlines()
    assert lines[0].split() == [
        "WORKER", "RANK", "NODE", "COLLECTOR", "STATE", "BATCHES", "GAPS", "LOST", "RESTARTS",
        "DUP", "LAG", "AGE", "USAGE", "TOKEN_USAGE", "REASON",
    ]  # fmt: skip
    rows = [ln.split()[:14] for ln in lines]  # REASON is free text
    # restarts 1, a duplicate, 250 ms lag, cache usage 25% next to the scheduler's token usage 30%
    sg0 = "sglang-a 0 0 node-0 up 100 2 2 1 yes 250ms - 25% 30%"
    # a stale stream (its collector is down) and a down one: no usage, not 0%
    sg3 = "sglang-a 3 2 node-2 stale 50 1 4 0 - - - - -"
    vl1 = (
        "vllm-b 1 0 node-0 down 0 0 0 0 - - - - -"  # down: whether it has two publishers is unknown
    )
    for row in (sg0, sg3, vl1):
        assert row.split() in rows, row
    assert "collectors: node-0 up (0.5s), node-1 up (0.2s), node-2 DOWN (10.0s)" in text
    assert "publisher past the last rank: sglang-a tcp://10.0.0.5:5561 (7 batches" in text
    dup = [ln for ln in lines if "duplicate_stream" in ln]
    assert dup and dup[0].split()[0] == "WARNING" and "dp_rank=0" in dup[0]
    down = [ln for ln in lines if "collector_down" in ln]
    assert down and down[0].split()[0] == "CRITICAL"
    assert (
        f"runbook: https://github.com/kvobserve/kvobserve/blob/v{__version__}/docs/alerts.md"
        "#kvobservecollectordown" in text
    )


async def test_status_exits_0_without_critical_conditions_and_takes_host_port() -> None:
    clean = FleetState()
    snap = Snapshot(
        CollectorInfo("node-0", 0, "gpu-0", 1000.0),
        seq=1,
        time=NOW - 0.5,
        workers=[WorkerInfo("w", "sglang", 1, [0], True)],
        streams=[
            StreamStats("w", 0, up=True, batches_total=5, state="up", reason="receiving",
                        state_complete=True)
        ],
        events=[Event(1, NOW - 30, "gap", "w", 0, "gap: seq 3-4 missed (2); recovered by replay")],
    )  # fmt: skip
    agg = Aggregator(clean, clock=lambda: NOW)
    agg.on_snapshot(encode_snapshot(snap), NOW - 0.5)
    srv = await serve(create_app(agg.view, events=lambda: list(agg.events)), "127.0.0.1:0")
    try:
        bare = srv.url.removeprefix("http://")  # 127.0.0.1:PORT, as a user types it
        rc, text = await _run(_args("--url", bare, "--events"))
    finally:
        await srv.close()
    assert rc == 0, text
    assert "1/1 streams up, 0 active conditions (none)" in text
    assert "recent events (1):" in text
    assert "gap           w 0              gap: seq 3-4 missed (2); recovered by replay" in text


async def test_status_with_basic_auth(monkeypatch: pytest.MonkeyPatch) -> None:
    state = rich_state()
    srv = await serve(create_app(lambda: state.view(NOW), basic_auth=("ops", "pw")), "127.0.0.1:0")
    try:
        rc, _ = await _run(_args("--url", srv.url))
        assert rc == 2  # 401 without credentials
        monkeypatch.setenv(statuscmd.PASSWORD_ENV, "pw")
        rc, text = await _run(_args("--url", srv.url, "--user", "ops", "--json"))
        assert rc == 1 and '"worker_id": "vllm-b"' in text  # 1: critical conditions
    finally:
        await srv.close()


def test_unreachable_url_exits_2_and_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()  # of this worker's block: nothing listens there
    url = f"http://127.0.0.1:{port}"
    assert statuscmd.run(_args("--url", url, "--timeout", "2")) == 2
    assert url in capsys.readouterr().err
