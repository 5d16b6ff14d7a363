"""`kvobserve status` against a live aggregator HTTP server, with auth, and when unreachable."""

from __future__ import annotations

import argparse
import asyncio
import io
import socket

import pytest

from kvobserve.commands import status as statuscmd
from kvobserve.export.server import create_app, serve
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
    assert rc == 0
    lines = text.splitlines()
    assert lines[0].split() == [
        "WORKER",
        "RANK",
        "NODE",
        "OWNER",
        "UP",
        "BATCHES",
        "GAPS",
        "LOST",
        "USAGE",
    ]
    rows = [ln.split() for ln in lines]
    assert ["sglang-a", "0", "0", "node-0", "up", "100", "2", "2", "25.0%"] in rows
    assert ["sglang-a", "3", "2", "node-2", "stale", "50", "1", "4", "-"] in rows
    assert "5/7 streams up, 8 active conditions" in text
    dup = [ln for ln in lines if "duplicate_stream" in ln]
    assert dup and dup[0].split()[0] == "CRITICAL" and "dp_rank=0" in dup[0]


async def test_status_with_basic_auth(monkeypatch: pytest.MonkeyPatch) -> None:
    state = rich_state()
    srv = await serve(create_app(lambda: state.view(NOW), basic_auth=("ops", "pw")), "127.0.0.1:0")
    try:
        rc, _ = await _run(_args("--url", srv.url))
        assert rc == 2  # 401 without credentials
        monkeypatch.setenv(statuscmd.PASSWORD_ENV, "pw")
        rc, text = await _run(_args("--url", srv.url, "--user", "ops", "--json"))
        assert rc == 0 and '"worker_id": "vllm-b"' in text
    finally:
        await srv.close()


def test_unreachable_url_exits_2_and_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    assert statuscmd.run(_args("--url", url, "--timeout", "2")) == 2
    assert url in capsys.readouterr().err
