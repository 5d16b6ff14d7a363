"""The status page renders in headless Chromium and shows workers, ownership and conditions."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from kvobserve.analysis.conditions import DEFAULT_RUNBOOK_URL as RUNBOOK
from kvobserve.export.server import create_app, serve
from tests.unit.test_export_fleet import NOW, rich_state

pytestmark = pytest.mark.integration

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def chromium() -> str:
    """Path of the Chromium binary; fails (never skips) when it is missing."""
    path = shutil.which("chromium") or (
        "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None
    )
    assert path, "chromium missing: apt-get install chromium (scripts/install-tools.sh)"
    return path


async def run_chromium(args: list[str], profile: Path, timeout_s: float = 60.0) -> str:
    """Run headless Chromium without blocking the loop that serves the page; return stdout."""
    proc = await asyncio.create_subprocess_exec(
        chromium(),
        *CHROMIUM_FLAGS,
        f"--user-data-dir={profile}",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out.decode()


async def test_status_page_in_headless_chromium(tmp_path: Path) -> None:
    state = rich_state()
    srv = await serve(create_app(lambda: state.view(NOW)), "127.0.0.1:0")
    try:
        dom = await run_chromium(["--dump-dom", f"{srv.url}/"], tmp_path / "profile")
        if os.environ.get("KVOBSERVE_SCREENSHOT"):
            shot = Path(os.environ["KVOBSERVE_SCREENSHOT"]).resolve()
            await run_chromium(
                [f"--screenshot={shot}", "--window-size=1400,1300", f"{srv.url}/"],
                tmp_path / "profile2",
            )
    finally:
        await srv.close()
    assert "<title>kvobserve fleet</title>" in dom
    # Workers, with the ownership grid: rank 1 twice owned (amber), rank 3 uncovered (red).
    assert "sglang-a" in dom and "vllm-b" in dom
    assert 'class="ownN"><b>rank 1</b><br>node-0<br>node-1' in dom
    assert 'class="own0"><b>rank 3</b><br>uncovered' in dom
    # The injected duplicate-stream condition is listed as a warning (the severity of its alert,
    # KVEventDuplicateStream), with a link to its runbook section.
    assert '<tr class="c-warning" data-kind="duplicate_stream">' in dom
    assert "two publishers (interleaved or mirrored)" in dom
    assert f'href="{RUNBOOK}#kveventduplicatestream">KVEventDuplicateStream</a>' in dom
    assert "3 collectors, 4 workers" in dom
    # what more memory would buy: the healthy pool's curve, its worker's as routed
    curve = dom[dom.index('id="capacity"') :]
    assert 'data-pool="vllm-d"' in curve and "one global cache" in curve and "as routed" in curve
    # A worker node-1 cannot discover: its state row is red (worker_undiscovered is critical) and
    # says why, though it has no rank to show; the down scheduler source's state is amber.
    assert (
        '<tr class="c-critical" data-state="undiscovered"><td>node-1</td><td><span class="st">'
        "undiscovered</span></td><td>connection refused at http://10.0.0.9:30000/server_info"
    ) in dom
    assert 'data-state="watching"><td>node-0</td>' in dom and "No rank known." in dom
    assert '<td class="c-warning"><span class="st">down</span></td>' in dom
    assert '<tr class="c-critical" data-kind="worker_undiscovered">' in dom
    # A down stream shows no usage ("-", not 0%); the stale node's stream is "stale".
    assert 'data-rank="1" data-state="down"' in dom and 'data-state="stale"' in dom
    # The idle probe is not a stray publisher; the active one is.
    assert 'id="strays-table"' in dom and "tcp://10.0.0.5:5561" in dom
