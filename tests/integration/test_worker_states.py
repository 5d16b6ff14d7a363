"""Acceptance (issue 21, seen 1 and 4): a configured worker that cannot be watched is never
invisible, and a node-count mismatch is one condition with its fix, not four outages.

`kvobserve run` runs as a user would start it, against a URL where nothing listens, and against
node 0 of a 2-node SGLang engine simulated on 127.0.0.1 / 127.0.0.2 (default `nnodes = 1`);
`kvobserve status` and `kvobserve check` read the result the way a person would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvobserve.simulate import SimConfig, SimulatorGroup, nodes_of
from kvobserve.simulate.ports import free_port, free_port_range
from tests.integration.fleet_helpers import ROOT, Procs, clean_env, fetch, scrape, write_toml
from tests.polling import until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

HOSTS = ("127.0.0.1", "127.0.0.2")
WORKER = "sglang-dp8"
FIX = (
    "the engine runs on 2 nodes, [collector] nnodes is 1; set [collector] nnodes = 2 and run a "
    "collector on each node"
)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()


def _run(procs: Procs, tmp_path: Path, url: str) -> tuple[int, str]:
    """`kvobserve run` with one worker given by `url` only, defaults elsewhere; (pid, base URL)."""
    listen = f"127.0.0.1:{free_port()}"
    cfg = write_toml(
        tmp_path / "kvobserve.toml",
        {
            "collector": {"id": "box", "interval_s": 0.5},
            "worker": [{"id": WORKER, "engine": "sglang", "url": url}],
            "http": {"listen": listen},
        },
    )
    return procs.kvobserve("run", "run", "-c", str(cfg)), f"http://{listen}"


def _json(base: str, path: str) -> Any:
    text = fetch(f"{base}{path}")
    return json.loads(text) if text is not None else None


def _status(base: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvobserve", "status", "--url", base],
        capture_output=True, text=True, timeout=30, env=clean_env(), cwd=ROOT,
    )  # fmt: skip


def test_a_worker_whose_discovery_fails_is_visible_everywhere(procs: Procs, tmp_path: Path) -> None:
    """Seen 1: nothing listens at the worker's url. Before, `status` said "(no streams)" with no
    condition and exit 0, and /api/v1/alerts was []."""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    pid, base = _run(procs, tmp_path, dead)
    reason = f"connection refused at {dead}/server_info"

    def alerts() -> list[dict[str, Any]] | None:
        got = _json(base, "/api/v1/alerts")
        return got if got else None

    got = until(alerts, 30, "a condition in /api/v1/alerts", lambda: procs.log(pid))
    assert [(a["kind"], a["severity"], a["alert"]) for a in got] == [
        ("worker_undiscovered", "critical", "KVWorkerUndiscovered")
    ]
    (a,) = got
    assert a["labels"] == {"worker_id": WORKER, "node_rank": "0", "collector": "box"}
    assert a["description"] == f"{WORKER} on box: undiscovered: {reason}"
    assert a["runbook_url"].endswith("docs/alerts.md#kvworkerundiscovered") and a["since"]

    fleet = _json(base, "/api/v1/fleet")
    (w,) = fleet["workers"]
    assert (w["worker_id"], w["dp_size"], w["owners"]) == (WORKER, 0, {})
    assert [(s["collector"], s["state"], s["reason"]) for s in w["states"]] == [
        ("box", "undiscovered", reason)
    ]
    m = scrape(base)
    assert m is not None
    assert m.by("kvobserve_worker_state", ("worker_id", "collector", "state")) == {
        (WORKER, "box", "undiscovered"): 1.0
    }

    status = _status(base)
    assert status.returncode == 1, status.stdout + status.stderr
    assert f"worker {WORKER} on box: undiscovered: {reason}" in status.stdout
    assert "1 active condition (1 critical)" in status.stdout

    page = fetch(f"{base}/")
    assert page is not None
    assert 'class="c-critical" data-state="undiscovered"><td>box</td>' in page
    assert reason in page and "No rank known." in page
    assert procs.alive(pid), procs.log(pid)


@pytest.fixture
def two_nodes() -> Iterator[SimulatorGroup]:
    """A 2-node SGLang 0.5.23 engine, dp_size 8 with DP attention: ranks 0-3 on 127.0.0.1, 4-7 on
    127.0.0.2, each publisher bound on its own node's address only; node 0 serves the HTTP API."""
    sim = SimConfig(
        format="sglang-0.5.23", dp_size=8, nnodes=2, topic="kv-events", rate=20.0, prompts=40,
        http_port=free_port_range(HOSTS, 1), capacity_tokens=8192,
    )  # fmt: skip
    g = SimulatorGroup(nodes_of(sim, HOSTS)).start()
    try:
        yield g
    finally:
        g.stop()


def test_a_node_count_mismatch_is_one_condition_with_the_fix(
    procs: Procs, tmp_path: Path, two_nodes: SimulatorGroup
) -> None:
    """Seen 4: `run` given node 0's URL of a 2-node engine with the default nnodes = 1. Before,
    ranks 4-7 were watched on 127.0.0.1 and raised four critical stream_down with no hint."""
    url = f"http://127.0.0.1:{two_nodes.workers[0].http_port}"
    pid, base = _run(procs, tmp_path, url)

    # the ranks it leaves uncovered count after DOWN_AFTER_S without an owner, as a stream does
    def mismatch() -> list[dict[str, Any]] | None:
        got = _json(base, "/api/v1/alerts")
        done = [a for a in got or [] if a["kind"] == "layout_mismatch" and a["consequences"]]
        return got if done and len(done[0]["consequences"]) == 4 else None

    got = until(mismatch, 30, "layout_mismatch and its consequences", lambda: procs.log(pid))
    assert [(a["kind"], a["severity"]) for a in got] == [("layout_mismatch", "critical")], got
    assert got[0]["labels"] == {"worker_id": WORKER, "node_rank": "0", "collector": "box"}
    assert got[0]["description"] == (
        f"{WORKER} on box: {FIX} (ranks 4-7 are not watched here: the engine does not run them "
        "on this node)"
    )
    assert got[0]["alert"] == "KVWorkerLayoutMismatch"
    # the ranks it leaves uncovered follow from it: under it, one entry (as Alertmanager mutes them)
    assert [(c["kind"], c["labels"]["dp_rank"]) for c in got[0]["consequences"]] == [
        ("dp_rank_uncovered", str(r)) for r in range(4, 8)
    ]

    # The ranks of this node are watched, and only those: nothing connects to 127.0.0.1:base+4..7.
    def receiving() -> list[dict[str, Any]] | None:
        streams = _json(base, "/api/v1/streams")
        return streams if streams and all(s["batches"] > 0 for s in streams) else None

    streams = until(receiving, 30, "batches on every watched stream", lambda: procs.log(pid))
    kv = two_nodes.workers[0].kv_base
    assert [(s["dp_rank"], s["endpoint"], s["up"]) for s in streams] == [
        (r, f"tcp://127.0.0.1:{kv + r}", True) for r in range(4)
    ]
    fleet = _json(base, "/api/v1/fleet")
    (w,) = fleet["workers"]
    assert w["owners"] == {str(r): ["box"] if r < 4 else [] for r in range(8)}
    assert [(s["state"], s["elsewhere"]) for s in w["states"]] == [
        ("layout_mismatch", [4, 5, 6, 7])
    ]
    m = scrape(base)
    assert m is not None
    assert m.by("kvobserve_worker_state", ("worker_id", "state")) == {
        (WORKER, "layout_mismatch"): 1.0
    }
    assert sorted(lb["dp_rank"] for lb, _ in m.get("kvobserve_stream_up")) == ["0", "1", "2", "3"]

    # One cause: no stream of ranks 4-7 to be down, and their empty ownership follows from the
    # mismatch (their dp_rank_uncovered listed under it, not as causes of their own).
    status = _status(base)
    assert status.returncode == 1, status.stdout
    assert "4/4 streams up, 1 active condition (1 critical), 4 more follow from it" in status.stdout
    assert f"worker {WORKER} on box: layout_mismatch: {FIX}" in status.stdout
    assert "stream_down" not in status.stdout
    uncovered = [ln for ln in status.stdout.splitlines() if "dp_rank_uncovered" in ln]
    assert len(uncovered) == 4 and all(ln.startswith(" " * 13) for ln in uncovered), uncovered

    # `kvobserve check` says the same, from the same code
    check = subprocess.run(
        [sys.executable, "-m", "kvobserve", "check", "--engine", "sglang", "--engine-url", url,
         "--worker-id", WORKER],
        capture_output=True, text=True, timeout=30, env=clean_env(), cwd=ROOT,
    )  # fmt: skip
    assert check.returncode == 1, check.stdout + check.stderr  # a gate: run raises it
    assert f"  note: {FIX}" in check.stdout
    assert check.stdout.endswith(f"  worker {WORKER}: layout_mismatch: {FIX}\n")
    assert "  4-7      -     (not watched: the engine does not run them on this node)" in (
        check.stdout
    )
    assert procs.alive(pid), procs.log(pid)
