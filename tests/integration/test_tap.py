"""`kvobserve tap` as a subprocess: recorded captures, bad input, and live SUB + replay DEALER."""

from __future__ import annotations

import base64
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvobserve.simulate import SimConfig, SimulatedWorker
from kvobserve.simulate.ports import free_port
from tests.unit.test_captures import CAPTURES, KV_FOLDERS, expected_batch, load_lines

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
TAP = [sys.executable, "-m", "kvobserve", "tap"]


def run_tap(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TAP, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
    )


def expected_lines(name: str, token_ids: bool = False) -> list[dict[str, Any]]:
    """What tap must print for a capture: one batch per live and per replayed batch, in order,
    with every field the engine set."""
    folder = CAPTURES / name
    by_key = {
        (e["dp_rank"], e["seq"]): e for e in json.loads((folder / "expected.json").read_text())
    }
    out = []
    for ln in load_lines(folder):
        seq_frame = ln["frames"][1] if ln["source"] == "live" else ln["frames"][-2]
        if seq_frame != b"\xff" * 8:
            key = (ln["dp_rank"], int.from_bytes(seq_frame, "big"))
            out.append(expected_batch(by_key[key], token_ids, view=True))
    return out


@pytest.mark.parametrize("name", KV_FOLDERS)
def test_tap_file_prints_every_live_and_replayed_batch(name: str) -> None:
    token_ids = name == "sglang-0.5.23"  # the folder with bigram token ids
    args = ["--file", str(CAPTURES / name / "frames.jsonl")] + ["--token-ids"] * token_ids
    proc = run_tap(*args)
    assert (proc.returncode, proc.stderr) == (0, "")
    got = [json.loads(line) for line in proc.stdout.splitlines()]
    want = expected_lines(name, token_ids)
    assert len(want) > 20
    assert got == want


def test_tap_file_count_and_record(tmp_path: Path) -> None:
    src = CAPTURES / "vllm-0.33.0" / "frames.jsonl"
    rec = tmp_path / "rec.jsonl"
    proc = run_tap("--file", str(src), "--count", "3", "--record", str(rec))
    assert proc.returncode == 0
    assert [json.loads(x) for x in proc.stdout.splitlines()] == expected_lines("vllm-0.33.0")[:3]
    recorded = [json.loads(x) for x in rec.read_text().splitlines()]
    original = [json.loads(x) for x in src.read_text().splitlines()[:3]]
    assert [r["frames"] for r in recorded] == [o["frames"] for o in original]
    assert all(r["source"] == "live" and r["dp_rank"] is None for r in recorded)


def test_malformed_message_is_reported_and_skipped(tmp_path: Path) -> None:
    lines = (CAPTURES / "sglang-0.5.12" / "frames.jsonl").read_text().splitlines()
    bad = {"source": "live", "frames": [base64.b64encode(b).decode() for b in (b"", b"\x00")]}
    f = tmp_path / "frames.jsonl"
    f.write_text("\n".join([lines[0], json.dumps(bad), lines[1]]) + "\n")
    proc = run_tap("--file", str(f))
    assert proc.returncode == 0
    assert [json.loads(x) for x in proc.stdout.splitlines()] == expected_lines("sglang-0.5.12")[:2]
    (err_line,) = proc.stderr.splitlines()
    err = json.loads(err_line)
    assert err["error"] == "frame_count" and err["at"] == f"{f}:2"


@pytest.mark.parametrize("endpoint", ["foo://x", "tcp://host:notaport", "tcp://*:5557"])
def test_bad_endpoint_exits_2_with_one_line(endpoint: str) -> None:
    proc = run_tap(endpoint)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and endpoint in proc.stderr


def test_bad_files_exit_2_with_one_line(tmp_path: Path) -> None:
    not_json = tmp_path / "notes.txt"
    not_json.write_text("hello\n")
    no_frames = tmp_path / "noframes.jsonl"
    no_frames.write_text('{"source": "live"}\n')
    for path in (tmp_path / "missing.jsonl", not_json, no_frames, tmp_path):
        proc = run_tap("--file", str(path))
        assert proc.returncode == 2, path
        assert len(proc.stderr.splitlines()) == 1 and str(path) in proc.stderr


def _wait_subscribed(xpub: zmq.Socket[bytes], topic: bytes, deadline: float) -> None:
    while time.monotonic() < deadline:
        if xpub.poll(100) and xpub.recv() == b"\x01" + topic:
            return
    raise AssertionError("tap never subscribed")


def test_live_tap_replays_then_reads_live(tmp_path: Path) -> None:
    lines = [ln for ln in load_lines(CAPTURES / "sglang-0.5.23") if ln["dp_rank"] == 0]
    live = [ln["frames"] for ln in lines if ln["source"] == "live"]
    replay = [ln["frames"] for ln in lines if ln["source"] == "replay"]  # 4-frame layout
    want = [w for w in expected_lines("sglang-0.5.23") if w["dp_rank"] == 0]
    want = want[len(live) :] + want[: len(live)]  # tap prints the replay first
    rec = tmp_path / "rec.jsonl"
    ctx = zmq.Context()
    xpub, router = ctx.socket(zmq.XPUB), ctx.socket(zmq.ROUTER)
    proc = None
    try:
        pub_port = xpub.bind_to_random_port("tcp://127.0.0.1")
        replay_port = router.bind_to_random_port("tcp://127.0.0.1")
        args = [f"tcp://127.0.0.1:{pub_port}", "--topic", "kv-events", "--from-seq", "2"]
        args += ["--replay-endpoint", f"tcp://127.0.0.1:{replay_port}"]
        args += ["--count", str(len(want)), "--timeout", "20", "--record", str(rec)]
        proc = subprocess.Popen([*TAP, *args], cwd=REPO, stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        _wait_subscribed(xpub, b"kv-events", deadline)
        assert router.poll(int((deadline - time.monotonic()) * 1000))
        ident, *request = router.recv_multipart()
        assert request == [b"", (2).to_bytes(8, "big")]
        for frames in replay:
            router.send_multipart([ident, *frames])
        for frames in live:
            xpub.send_multipart(frames)
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        assert proc.returncode == 0
        assert [json.loads(x) for x in out.splitlines()] == want
        recorded = [json.loads(x) for x in rec.read_text().splitlines()]
        assert [r["source"] for r in recorded] == ["replay"] * len(replay) + ["live"] * len(live)
        sent = [[base64.b64encode(f).decode() for f in fr] for fr in replay + live]
        assert [r["frames"] for r in recorded] == sent
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        ctx.destroy(linger=0)


def test_live_tap_stops_on_sigterm() -> None:
    first = load_lines(CAPTURES / "vllm-0.23.0")[0]["frames"]
    ctx = zmq.Context()
    xpub = ctx.socket(zmq.XPUB)
    proc = None
    try:
        port = xpub.bind_to_random_port("tcp://127.0.0.1")
        proc = subprocess.Popen(
            [*TAP, f"tcp://127.0.0.1:{port}"], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None
        deadline = time.monotonic() + 30
        _wait_subscribed(xpub, b"", deadline)
        xpub.send_multipart(first)
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, "tap printed nothing"
        assert json.loads(proc.stdout.readline()) == expected_lines("vllm-0.23.0")[0]
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=2) == 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        ctx.destroy(linger=0)


# --- why nothing comes: one line and a non-zero exit instead of silence --------------------------


@pytest.fixture(scope="module")
def engine() -> Iterator[SimulatedWorker]:
    """A simulated SGLang engine publishing under topic 'kv-events', with its HTTP port."""
    sim = SimulatedWorker(
        SimConfig(worker_id="tap", format="sglang-0.5.23", dp_size=1, topic="kv-events", rate=20)
    ).start()
    yield sim
    sim.stop()


def _timed(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    proc = run_tap(*args, timeout=30)
    return proc, time.monotonic() - start


def test_nothing_listening_exits_1_with_the_reason() -> None:
    ep = f"tcp://127.0.0.1:{free_port()}"
    for extra in ([], ["--count", "1"]):
        proc, took = _timed(ep, "--timeout", "3", *extra)
        assert proc.returncode == 1 and proc.stdout == ""
        assert proc.stderr == (
            f"kvobserve tap: nothing received in 3 s from {ep}: connection refused: nothing "
            "listens there (is the engine publishing? check its --kv-events-config)\n"
        )
        assert took < 10


@pytest.mark.parametrize("timeout", [["--timeout", "3"], []])
def test_http_port_stops_at_once_with_one_line(engine: SimulatedWorker, timeout: list[str]) -> None:
    """Issue 30: ten JSON error lines (one per HTTP answer read as a message) came before the
    hint; the first HTTP answer now ends tap with the hint alone, with --timeout or without."""
    ep = f"tcp://127.0.0.1:{engine.http_port}"
    proc, took = _timed(ep, *timeout)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == (
        f"kvobserve tap: {ep}: not a ZMQ publisher: it answers like an HTTP server (the "
        "engine's HTTP port?); KV events come from the endpoint in the engine's "
        "--kv-events-config\n"
    )
    assert took < 10  # it stopped by itself


def test_wrong_topic_names_the_topic_seen(engine: SimulatedWorker) -> None:
    ep = f"tcp://127.0.0.1:{engine.kv_base}"
    proc, _ = _timed(ep, "--topic", "foo", "--timeout", "3")
    assert proc.returncode == 1 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"kvobserve tap: nothing under topic 'foo' in 3 s from {ep}, but ")
    assert line.endswith("under 'kv-events': use --topic 'kv-events', or leave --topic out")


def test_without_timeout_it_says_why_once_and_keeps_waiting() -> None:
    ep = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([*TAP, ep], cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        ready, _, _ = select.select([proc.stderr], [], [], 20)
        assert ready, "no hint within 20 s"
        line = proc.stderr.readline()
        assert line == (
            f"kvobserve tap: nothing received yet from {ep}: connection refused: nothing listens "
            "there (is the engine publishing? check its --kv-events-config); still waiting "
            "(Ctrl-C stops)\n"
        )
        assert proc.poll() is None  # still waiting
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- --bind: publishers that connect (vLLM given a host, llm-d's central mode) ---------------------


def _bound_tap(*args: str) -> tuple[subprocess.Popen[str], str]:
    """A `tap --bind` started, once it says where it listens (stderr's first line)."""
    proc = subprocess.Popen(
        [*TAP, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stderr is not None
    ready, _, _ = select.select([proc.stderr], [], [], 20)
    assert ready, "tap --bind said nothing within 20 s"
    return proc, proc.stderr.readline()


def test_bound_tap_prints_each_connected_pods_batches_under_its_topic() -> None:
    """Two llm-d pods (their own loopback addresses) connect to one bound tap: every batch of
    each is printed once, in order, under the pod's own topic."""
    port = free_port()
    pods = {f"kv@127.0.0.{k}:8000@model-{k}": f"127.0.0.{k}" for k in (2, 3)}
    proc, first = _bound_tap("--bind", f"tcp://*:{port}", "--count", "40", "--timeout", "20")
    sims = []
    try:
        assert (
            first == f"kvobserve tap: listening on tcp://0.0.0.0:{port}; publishers connect here\n"
        )
        for topic, host in pods.items():
            cfg = SimConfig(worker_id=host, format="vllm-0.33", dp_size=1, topic=topic, rate=50,
                            max_batches=20, start_delay_s=2.0, host=host, http_port=None,
                            replay_port=None, kv_connect=f"tcp://127.0.0.1:{port}")  # fmt: skip
            sims.append(SimulatedWorker(cfg).start())
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    finally:
        for sim in sims:
            sim.stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [json.loads(x) for x in out.splitlines()]
    seqs: dict[str, list[int]] = {}
    for line in lines:
        seqs.setdefault(line["topic"], []).append(line["seq"])
        assert line["events"] and all("type" in e for e in line["events"])
    assert seqs == {topic: list(range(20)) for topic in pods}


def test_bound_tap_says_whether_anyone_connected() -> None:
    ep = f"tcp://127.0.0.1:{free_port()}"
    proc, took = _timed("--bind", ep, "--timeout", "2")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines()[-1] == (
        f"kvobserve tap: nothing received in 2 s on {ep}: no publisher connected (the engines' "
        f"--kv-events-config endpoint must name this host, port {ep.rpartition(':')[2]})"
    )
    assert took < 10


def test_bound_tap_names_what_holds_the_port_or_the_host_it_cannot_bind() -> None:
    ctx = zmq.Context()
    try:
        holder = ctx.socket(zmq.SUB)
        port = holder.bind_to_random_port("tcp://127.0.0.1")
        proc = run_tap("--bind", f"tcp://127.0.0.1:{port}", "--timeout", "2")
        assert proc.returncode == 1 and proc.stdout == ""
        assert proc.stderr.splitlines()[-1].startswith(
            f"kvobserve tap: cannot bind tcp://127.0.0.1:{port}: Address already in use "
            "(another process binds that port: a second kvobserve, or the scheduler"
        )
    finally:
        ctx.destroy(linger=0)
    proc = run_tap("--bind", "tcp://192.0.2.7:5557")  # TEST-NET-1: nobody's address
    assert proc.returncode == 2 and proc.stderr == (
        "kvobserve tap: bad --bind 'tcp://192.0.2.7:5557': '192.0.2.7' in "
        "'tcp://192.0.2.7:5557' is not an address of this machine, so it cannot be bound: bind "
        "tcp://*:5557 (every address of this machine; the engines connect to its name)\n"
    )
    proc = run_tap("--bind", "tcp://*:5557", "--replay-endpoint", "tcp://127.0.0.1:5558")
    assert proc.returncode == 2 and "--replay-endpoint asks one publisher" in proc.stderr
