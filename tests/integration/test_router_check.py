"""Acceptance (issue 30 item 6): the router check from a live stream answers on a busy rank.

The conversation trace replayed on a simulated vLLM worker of 2 ranks at 2x, each rank
publishing a batch every 4 s, so a batch holds several requests (the trace sends ~3 a second to
each rank; those whose full blocks were all cached store nothing). `kvobserve run` watches it.
As a user would, in a shell pipe:

- `kvobserve tap EP --count 1 | kvobserve overlap --url URL` (the documented line) answers for
  every request of the batch: it used to fail with "the input holds more than one request";
- `kvobserve tap EP --requests --count 1 | kvobserve overlap --url URL` answers for one request.

Every answer is checked: the tapped rank holds every block asked of the request it just stored
(a rank's cache holds 62,500 pages: its least recently used go first, the request's last). The
machine is shared: a collector answers between two batches of its ingest thread and sends its
snapshots from its loop, which a loaded core slows, so overlap waits up to 5 s (`--wait 5`) and
the collector is down after 10 intervals without a snapshot, not 3 (`stale_intervals`).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvobserve.simulate import SimConfig, SimulatorGroup
from kvobserve.simulate.ports import free_port
from tests.integration.fleet_helpers import ROOT, Procs, clean_env, fetch, write_toml
from tests.polling import until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TRACE = ROOT / "tests" / "fixtures" / "traces" / "mooncake-conversation.jsonl.gz"
RUNS = 3  # each pipeline, one after the other: every one must answer
OVERLAP = ["overlap", "--wait", "5", "--url"]
ASKED = re.compile(r"^(\d+) hashes asked of every worker \(tr\)$", re.M)
ROW = re.compile(r"^tr +0 +(\d) +(\d+) +(\w+) +box$", re.M)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()


@pytest.fixture
def replay() -> Iterator[SimulatorGroup]:
    """The trace on 2 SGLang ranks, after a delay for the collector to connect first."""
    cfg = SimConfig(
        worker_id="tr", format="vllm-0.33", dp_size=2, rate=0.25, trace=str(TRACE),
        speed=2.0, trace_seconds=900.0, capacity_tokens=1_000_000, start_delay_s=3.0,
        replay_port=None, http_port=None,
    )  # fmt: skip
    g = SimulatorGroup([cfg]).start()
    try:
        yield g
    finally:
        g.stop()


def _pipe(left: list[str], right: list[str]) -> tuple[int, int, str, str]:
    """`kvobserve LEFT | kvobserve RIGHT`: (exit codes, right's stdout, both stderrs)."""
    run = [sys.executable, "-m", "kvobserve"]
    env = clean_env()
    a = subprocess.Popen([*run, *left], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                         cwd=ROOT)  # fmt: skip
    b = subprocess.Popen([*run, *right], stdin=a.stdout, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)  # fmt: skip
    assert a.stdout is not None and a.stderr is not None
    a.stdout.close()  # the right side owns it now
    try:
        out, err = b.communicate(timeout=60)
        left_err = a.stderr.read().decode()
        return a.wait(timeout=30), b.returncode, out, left_err + err
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
                p.wait(timeout=5)


def _answers(out: str) -> list[tuple[int, dict[int, int]]]:
    """Each request's (hashes asked, {dp_rank: leading blocks}) from overlap's tables."""
    blocks = ASKED.split(out)[1:]  # [n, table, n, table, ...]
    return [
        (int(n), {int(r): int(lead) for r, lead, _ in ROW.findall(table)})
        for n, table in zip(blocks[::2], blocks[1::2], strict=True)
    ]


def test_tap_piped_into_overlap_answers_on_a_busy_rank(
    replay: SimulatorGroup, procs: Procs, tmp_path: Path
) -> None:
    ep = f"tcp://127.0.0.1:{replay.workers[0].kv_base}"  # rank 0
    listen = f"127.0.0.1:{free_port()}"
    worker = {"id": "tr", "engine": "vllm", "kv_endpoint": ep, "dp_size": 2}
    # a loaded machine delays the collector's snapshots behind a large batch: not down for that
    cfg = write_toml(tmp_path / "kvobserve.toml",
                     {"collector": {"id": "box"}, "worker": [worker], "http": {"listen": listen},
                      "aggregator": {"stale_intervals": 10}})  # fmt: skip
    pid = procs.kvobserve("run", "run", "-c", str(cfg))
    url = f"http://{listen}"

    def busy() -> bool:  # past the replay's first batches, which hold its first requests only
        streams = json.loads(fetch(f"{url}/api/v1/streams") or "[]")
        return len(streams) == 2 and all(s["batches"] >= 3 for s in streams)

    until(busy, 60, "3 batches on both ranks", lambda: procs.log(pid))

    several = []
    for _ in range(RUNS):  # the documented line: the whole batch, request by request
        rc_tap, rc, out, err = _pipe(["tap", ep, "--count", "1", "--timeout", "20"],
                                     [*OVERLAP, url])  # fmt: skip
        assert (rc_tap, rc) == (0, 0), out + err
        answers = _answers(out)
        titles = re.findall(r"^request (\d+) of (\d+): seq \d+ request (\d+) \(stdin line 1\)",
                            out, re.M)  # fmt: skip
        assert len(titles) == len(answers) >= 2, out  # a busy rank: several requests a batch
        assert [int(k) for k, _, _ in titles] == list(range(1, len(answers) + 1))
        for n, leading in answers:
            assert set(leading) == {0, 1} and leading[0] == n, out
            assert f"most: {n} of {n} blocks, on tr rank 0" in out
        several.append(len(answers))

    for _ in range(RUNS):  # its replacement: one request
        rc_tap, rc, out, err = _pipe(["tap", ep, "--requests", "--count", "1", "--timeout", "20"],
                                     [*OVERLAP, url])  # fmt: skip
        assert (rc_tap, rc) == (0, 0), out + err
        ((n, leading),) = _answers(out)
        assert leading[0] == n and n > 0, out
        assert out.count("hashes asked") == 1 and "request 1 of" not in out
    assert procs.alive(pid), procs.log(pid)
    print(f"requests per tapped batch: {several}")
