"""A lost collector is one cause: the page, `kvobserve status` and /api/v1/alerts (issue 30).

Seen: losing one collector of a two-node sglang-dp8 showed "9 active conditions (9 critical)"
(collector_down, 4 x stream_down, 4 x dp_rank_uncovered) on the page and in `status`, while
Alertmanager with the shipped config sent one page. Here node-1 has been silent for 10 s: the
API serves one critical cause with its eight consequences under it, `status` prints them under
it and exits 1 (by that one cause), and the page, rendered by headless Chromium, shows one row
with what follows from it beneath. The screenshot lands in build/status-page/lost-collector.png
(or $KVOBSERVE_ARTIFACTS) for a person to look at.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from kvobserve.analysis.fleet import FleetState
from kvobserve.export.server import create_app, serve
from kvobserve.wire.snapshot import CollectorInfo, Snapshot, StreamStats, WorkerInfo
from tests.integration.test_export_status_page import run_chromium
from tests.integration.test_export_statuscmd import _args, _run
from tests.integration.test_status_page_cases import artifacts
from tests.integration.test_worker_states import _json

NOW = 1_700_000_000.0
W = "sglang-dp8"


def _node(node: int, at: float, gap: bool = False) -> Snapshot:
    ranks = list(range(4 * node, 4 * node + 4))
    streams = [
        StreamStats(W, r, up=True, state="up", reason="receiving", batches_total=500,
                    state_complete=True, state_since=NOW - 600, trust="complete")
        for r in ranks
    ]  # fmt: skip
    if gap:  # an unrelated condition of the live node: its own entry
        streams[1] = StreamStats(W, ranks[1], up=True, state="up", reason="receiving",
                                 batches_total=500, state_complete=True, gaps=1, missed=5,
                                 recovered=5, last_gap_time=NOW - 30, trust="replay_filled")  # fmt: skip
    return Snapshot(CollectorInfo(f"node-{node}", node, f"gpu-{node}", 1.0), seq=7, time=at,
                    interval_s=1.0, workers=[WorkerInfo(W, "sglang", 8, ranks, node == 0)],
                    streams=streams)  # fmt: skip


def _fleet() -> FleetState:
    state = FleetState()
    state.update(_node(0, NOW - 0.5, gap=True), NOW - 0.5)
    state.update(_node(1, NOW - 10.0), NOW - 10.0)  # silent for 10 intervals: down
    return state


async def test_a_lost_collector_is_one_critical_cause_everywhere(tmp_path: Path) -> None:
    state = _fleet()
    srv = await serve(create_app(lambda: state.view(NOW)), "127.0.0.1:0")
    try:
        alerts = await asyncio.to_thread(_json, srv.url, "/api/v1/alerts")  # urllib blocks
        rc, text = await _run(_args("--url", srv.url))
        dom = await run_chromium(["--dump-dom", f"{srv.url}/"], tmp_path / "p1")
        shot = artifacts() / "lost-collector.png"
        await run_chromium(
            [f"--screenshot={shot}", "--window-size=1500,1100", f"{srv.url}/"], tmp_path / "p2"
        )
    finally:
        await srv.close()

    # /api/v1/alerts: one critical cause, its streams and ranks under it; the gap on its own
    assert [(a["kind"], a["severity"]) for a in alerts] == [
        ("collector_down", "critical"),
        ("sequence_gap", "info"),
    ]
    lost, gap = alerts
    assert lost["labels"] == {"collector": "node-1", "node_rank": "1"}
    then = sorted((c["kind"], c["labels"]["dp_rank"]) for c in lost["consequences"])
    assert then == sorted(
        (k, str(r)) for k in ("stream_down", "dp_rank_uncovered") for r in range(4, 8)
    )
    assert all(c["labels"]["collector"] == "node-1" for c in lost["consequences"])
    assert all(c["since"] == lost["since"] == NOW - 10.0 for c in lost["consequences"])
    assert gap["consequences"] == []

    # `kvobserve status`: the same, exits 1 once (one critical cause)
    assert rc == 1
    assert (
        "4/8 streams up, 2 active conditions (1 critical, 1 info), 8 more follow from them" in text
    )
    lines = text.splitlines()
    i = next(n for n, ln in enumerate(lines) if ln.split()[:2] == ["CRITICAL", "collector_down"])
    assert lines[i + 2].strip() == "follows from it (muted in Alertmanager under it):"
    under = [ln.split()[:3] for ln in lines[i + 3 : i + 11]]
    assert sorted(u[1] for u in under) == ["dp_rank_uncovered"] * 4 + ["stream_down"] * 4
    assert [ln for ln in lines if ln.lstrip().startswith("CRITICAL")] == [lines[i]] + [
        lines[n] for n in range(i + 3, i + 11)
    ]  # every other critical line is indented under the cause

    # the page: one critical row, what follows beneath it; the streams' cells still tinted
    assert "2 active conditions (1 critical, 1 info), 8 more follow from them" in dom
    table = dom.split('id="alerts-table"', 1)[1].split("</table></td></tr>", 1)
    top = re.findall(r'<tr class="c-(\w+)" data-kind="(\w+)">', dom.split('id="alerts-table"')[1])
    assert top == [("critical", "collector_down"), ("info", "sequence_gap")], top
    assert 'data-cause="collector_down"' in table[0]
    assert table[0].count('<tr data-kind="stream_down">') == 4
    assert table[0].count('<tr data-kind="dp_rank_uncovered">') == 4
    assert (
        "follows from it, muted in Alertmanager under it: 4 dp_rank_uncovered, 4 stream_down" in dom
    )
    stale = re.findall(r'<tr data-rank="(\d)" data-state="stale">.*?</tr>', dom)
    assert stale == ["4", "5", "6", "7"]
    assert dom.count('class="c-critical"><span class="st">stale</span>') == 4
    assert shot.stat().st_size > 20_000  # a rendered page, not a blank one
