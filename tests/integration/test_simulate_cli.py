"""`kvobserve simulate` as a process: endpoint lines, batches, SIGTERM within 2 s, truth file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from kvobserve.wire.kv_events import decode_message

pytestmark = pytest.mark.integration


def _parse(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in line.split()[1:])


def test_cli_serves_stops_on_sigterm_and_writes_truth(tmp_path: Path) -> None:
    truth = tmp_path / "truth.json"
    cmd = [sys.executable, "-m", "kvobserve", "simulate", "--format", "vllm-0.33-bytes",
           "--dp-size", "2", "--rate", "100", "--no-http", "--seed", "5", "--truth", str(truth),
           "--drop-seqs", "3", "--fault-ranks", "0"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        assert proc.stdout is not None
        endpoints = []
        end = time.monotonic() + 20
        while True:
            line = proc.stdout.readline()
            assert line and time.monotonic() < end, (
                f"no ready line: {proc.stderr.read() if proc.stderr else ''}"
            )
            if line.startswith("ready"):
                break
            assert line.startswith("endpoint ")
            endpoints.append(_parse(line))
        kinds = sorted((e["kind"], e["dp_rank"]) for e in endpoints)
        assert kinds == [("kv", "0"), ("kv", "1"), ("replay", "0"), ("replay", "1")]
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(next(e["url"] for e in endpoints if e["kind"] == "kv" and e["dp_rank"] == "1"))
        batch = None
        while batch is None or batch.seq < 5:  # run long enough for rank 0 to pass seq 3
            assert sub.poll(5000), "no batch"
            batch = decode_message(sub.recv_multipart())
        sub.close(0)
        assert batch.dp_rank == 1
        hashes = [h for ev in batch.events for h in getattr(ev, "block_hashes", [])]
        assert hashes and all(isinstance(h, bytes) and len(h) == 32 for h in hashes)

        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        assert time.monotonic() - t0 < 2.0
        doc = json.loads(truth.read_text())
        (worker,) = doc["workers"]
        inst = worker["ranks"]["0"]["instances"][0]
        assert inst["batches"] > 3 and inst["live_dropped_seqs"] == [3]
        resident = inst["resident"]["GPU"]
        assert resident and all(isinstance(h, str) and len(h) == 64 for h in resident)
        assert worker["ranks"]["1"]["instances"][0]["live_dropped_seqs"] == []
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        ctx.destroy(linger=0)


def test_cli_bad_flag_names_the_field() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvobserve", "simulate", "--format", "sglang-9.9", "--no-http"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "format" in proc.stderr and "sglang-9.9" in proc.stderr


def test_cli_all_nodes_on_their_own_hosts() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvobserve", "simulate", "--format", "sglang-0.5.22", "--dp-size",
         "4", "--nnodes", "2", "--all-nodes", "--node-hosts", "127.0.0.1,127.0.0.2",
         "--duration", "0.2"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    eps = [_parse(line) for line in proc.stdout.splitlines() if line.startswith("endpoint ")]
    kv = {e["dp_rank"]: e["url"].rsplit(":", 1)[0] for e in eps if e["kind"] == "kv"}
    assert kv == {"0": "tcp://127.0.0.1", "1": "tcp://127.0.0.1",
                  "2": "tcp://127.0.0.2", "3": "tcp://127.0.0.2"}  # fmt: skip
    assert [e["url"].rsplit(":", 1)[0] for e in eps if e["kind"] == "http"] == ["http://127.0.0.1"]
    assert "ready workers=2" in proc.stdout


def test_cli_one_node_binds_on_its_own_entry_of_node_hosts() -> None:
    """Issue 30: `--node-rank 1 --node-hosts 127.0.0.1,127.0.0.2` (node 1 run alone) bound node
    0's address, 127.0.0.1, so a collector given node 1's address found nothing there."""
    argv = [sys.executable, "-m", "kvobserve", "simulate", "--dp-size", "4", "--nnodes", "2",
            "--node-rank", "1", "--node-hosts", "127.0.0.1,127.0.0.2", "--duration", "0.2"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    eps = [_parse(line) for line in proc.stdout.splitlines() if line.startswith("endpoint ")]
    assert sorted((e["kind"], e["dp_rank"], e["url"].rsplit(":", 1)[0]) for e in eps) == [
        ("http", "-", "http://127.0.0.2"),
        ("kv", "2", "tcp://127.0.0.2"), ("kv", "3", "tcp://127.0.0.2"),
        ("replay", "2", "tcp://127.0.0.2"), ("replay", "3", "tcp://127.0.0.2"),
    ]  # fmt: skip
    # a --host that contradicts the list is a mistake, named
    proc = subprocess.run(
        [*argv, "--host", "127.0.0.1"], capture_output=True, text=True, timeout=30
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (
        "kvobserve simulate: host: '127.0.0.1', but node_hosts puts node_rank 1 on "
        "'127.0.0.2': give one of them\n"
    )
