"""`kvobserve tap` on a running `kvobserve simulate`: it shows the worker's batches, and replaying
every published batch through the block index gives exactly the truth file's resident set."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvobserve.analysis.blocks import BlockIndex
from kvobserve.wire.kv_events import hash_json
from kvobserve.wire.replay import decode_replay_message
from tests.polling import until

BATCHES = 60


def _endpoints(proc: subprocess.Popen[str]) -> dict[str, str]:
    """Read `endpoint kind=... url=...` lines until `ready`."""
    assert proc.stdout is not None
    urls: dict[str, str] = {}
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line or line.startswith("ready"):
            break
        fields = dict(f.split("=", 1) for f in line.split()[1:])
        urls[fields["kind"]] = fields["url"]
    return urls


def _published(truth_file: Path) -> dict[str, Any] | None:
    """The rank-0 instance of the truth file once every batch was published, else None."""
    try:
        truth = json.loads(truth_file.read_text())
    except (OSError, ValueError):
        return None
    inst = truth["workers"][0]["ranks"]["0"]["instances"][0]  # the CLI writes a group truth
    return inst if inst["batches"] >= BATCHES else None


@pytest.mark.parametrize("fmt", ["sglang-0.5.19", "vllm-0.33-bytes"])
def test_tap_shows_the_simulated_batches_and_they_rebuild_the_truth(
    tmp_path: Path, fmt: str
) -> None:
    truth_file, record = tmp_path / "truth.json", tmp_path / "frames.jsonl"
    sim = subprocess.Popen(
        [sys.executable, "-m", "kvobserve", "simulate", "--format", fmt, "--dp-size", "1",
         "--rate", "400", "--max-batches", str(BATCHES), "--no-http", "--truth", str(truth_file),
         "--truth-interval", "0.2", "--flush-every", "25"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        urls = _endpoints(sim)
        inst = until(lambda: _published(truth_file), 20, "the simulator published its batches")
        tap = subprocess.run(
            [sys.executable, "-m", "kvobserve", "tap", urls["kv"], "--replay-endpoint",
             urls["replay"], "--from-seq", "0", "--count", str(BATCHES), "--timeout", "10",
             "--record", str(record)],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    finally:
        sim.terminate()
        sim.wait(timeout=5)
    assert tap.returncode == 0, tap.stderr
    lines = [json.loads(x) for x in tap.stdout.splitlines()]
    assert [b["seq"] for b in lines] == list(range(BATCHES))
    assert sum(len(b["events"]) for b in lines) == inst["events"]

    index = BlockIndex()
    for line in record.read_text().splitlines():
        msg = json.loads(line)
        frames = [base64.b64decode(f) for f in msg["frames"]]
        batch = decode_replay_message(frames)
        if batch is not None:
            index.apply_batch(batch)
    got = {m: sorted(map(str, map(hash_json, hs))) for m, hs in index.resident_hashes().items()}
    want = {m: sorted(map(str, hs)) for m, hs in inst["resident"].items()}
    assert sum(map(len, want.values())) > 0  # the flush at 50 did not leave it empty
    assert got == want
    assert index.tokens == inst["resident_tokens"]
