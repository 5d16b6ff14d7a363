"""`kvobserve check --probe` connects to every endpoint and URL and says what is there, per rank."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvobserve.simulate import SimConfig, SimulatedWorker
from kvobserve.simulate.ports import free_port
from tests.integration.fleet_helpers import ROOT, clean_env, write_toml

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine() -> Iterator[SimulatedWorker]:
    """A 2-rank simulated SGLang engine under topic 'kv-events', with replay and HTTP."""
    sim = SimulatedWorker(
        SimConfig(worker_id="e", format="sglang-0.5.23", dp_size=2, topic="kv-events", rate=50)
    ).start()
    yield sim
    sim.stop()


def _check(config: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvobserve", "check", "-c", str(config), *flags],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def _worker(sim: SimulatedWorker, wid: str, **kw: object) -> dict[str, object]:
    w: dict[str, object] = {
        "id": wid,
        "engine": "sglang",
        "kv_endpoint": f"tcp://127.0.0.1:{sim.kv_base}",
        "replay_endpoint": f"tcp://127.0.0.1:{sim.replay_base}",
        "topic": "kv-events",
        "dp_size": 2,
        "dp_attention": True,
    }
    w.update(kw)
    return {k: v for k, v in w.items() if v is not None}


def test_probe_finds_what_is_wrong_per_rank(engine: SimulatedWorker, tmp_path: Path) -> None:
    http = engine.http_port
    dead = free_port()
    cfg = write_toml(
        tmp_path / "k.toml",
        {
            "worker": [
                # one rank too many: nothing listens on the third port (nor its replay port)
                _worker(engine, "too-many", dp_size=3, metrics_url=f"http://127.0.0.1:{http}/metrics"),
                _worker(engine, "http-port", kv_endpoint=f"tcp://127.0.0.1:{http}", dp_size=1,
                        replay_endpoint=None, metrics_url=f"http://127.0.0.1:{dead}/metrics"),
                _worker(engine, "topic", topic="foo", replay_endpoint=None, probe_extra_ports=0),
            ]
        },
    )  # fmt: skip
    plain = _check(cfg)
    assert plain.returncode == 0 and ": valid" in plain.stdout
    assert "endpoints not contacted: `kvobserve check --probe` connects to each" in plain.stdout
    proc = _check(cfg, "--probe", "--probe-seconds", "2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    kv = engine.kv_base
    assert f"ok  stream  rank 0   tcp://127.0.0.1:{kv}" in out
    assert "up: receiving; " in out and "topic 'kv-events'; events as tagged maps" in out
    assert (
        f"BAD stream  rank 2   tcp://127.0.0.1:{kv + 2}            connecting: connection "
        "refused: nothing listens there" in out
    )
    assert f"ok  probe   rank 3   tcp://127.0.0.1:{kv + 3}" in out
    assert "nothing publishes here (as expected)" in out
    assert f"BAD stream  rank 0   tcp://127.0.0.1:{http}" in out
    assert "it answers like an HTTP server (the engine's HTTP port?)" in out
    assert f"BAD metrics          http://127.0.0.1:{dead}/metrics" in out
    assert "down: cannot connect" in out
    assert "wrong_topic: topic mismatch: configured 'foo', saw 'kv-events'" in out
    assert "replay  rank 0" in out and "reachable" in out
    # the JSON form carries the same per endpoint
    doc = json.loads(_check(cfg, "--probe", "--probe-seconds", "1", "--json").stdout)
    by_id = {w["worker_id"]: w for w in doc["workers"]}
    rank2 = next(
        p for p in by_id["too-many"]["probe"] if p["role"] == "stream" and p["dp_rank"] == 2
    )
    assert (rank2["ok"], rank2["state"]) == (False, "connecting")
    good = next(
        p for p in by_id["too-many"]["probe"] if p["role"] == "stream" and p["dp_rank"] == 0
    )
    assert good["ok"] and good["batches"] > 0 and good["topics"] == {"kv-events": good["batches"]}


def test_probe_of_a_healthy_engine_exits_0(engine: SimulatedWorker, tmp_path: Path) -> None:
    cfg = write_toml(
        tmp_path / "ok.toml",
        {"worker": [_worker(engine, "ok", metrics_url=f"http://127.0.0.1:{engine.http_port}/metrics")]},
    )  # fmt: skip
    proc = _check(cfg, "--probe", "--probe-seconds", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "BAD" not in proc.stdout and "up: HTTP 200" in proc.stdout


# --- bind mode: the endpoints this node binds, and the relay's target ------------------------------


def _polled_sub(
    ctx: zmq.Context[zmq.Socket[bytes]], stop: threading.Event, threads: list[threading.Thread]
) -> int:
    """A scheduler stand-in: a SUB bound on a free port, subscribed to everything and polled (a
    socket attaches its peers, and sends them its subscriptions, only when it is used)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")

    def loop() -> None:
        while not stop.is_set():
            if sub.poll(50):
                sub.recv_multipart()
        sub.close(linger=0)

    threads.append(threading.Thread(target=loop, daemon=True))
    threads[-1].start()
    return port


def _bound_worker(wid: str, port: int, target: int) -> dict[str, object]:
    return {"id": wid, "engine": "vllm", "bind": f"tcp://127.0.0.1:{port}",
            "topic": "kv@{pod}@{model}", "relay_to": f"tcp://127.0.0.1:{target}"}  # fmt: skip


def _probed(proc: subprocess.CompletedProcess[str]) -> dict[tuple[str, str], dict[str, object]]:
    """(worker id, role) -> what `check --probe --json` found."""
    plan = json.loads(proc.stdout)
    return {(w["worker_id"], f["role"]): f for w in plan["workers"] for f in w.get("probe", [])}


def test_probe_binds_what_this_node_binds_and_asks_the_relay_target(tmp_path: Path) -> None:
    """Nothing connected and no target: both BAD, with the reason; the port held by another
    process: named; two llm-d pods connected and a subscribing target: ok, exit 0."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    stop = threading.Event()
    threads: list[threading.Thread] = []
    sims = []
    try:
        holder = ctx.socket(zmq.SUB)
        held = holder.bind_to_random_port("tcp://127.0.0.1")
        port, target = free_port(), free_port()
        cfg = write_toml(tmp_path / "b.toml", {"worker": [
            _bound_worker("alone", port, target), _bound_worker("held", held, target)]})  # fmt: skip
        proc = _check(cfg, "--probe", "--probe-seconds", "2")
        assert proc.returncode == 1, proc.stdout + proc.stderr
        lines = [" ".join(line.split()) for line in proc.stdout.splitlines()]  # columns: 1 space
        assert (
            f"BAD bound rank 0 tcp://127.0.0.1:{port} listening: no publisher connected in 2 s "
            f"(the engines' --kv-events-config endpoint must name this host, port {port})" in lines
        )
        assert (
            f"BAD relay rank 0 tcp://127.0.0.1:{target} connecting: connection refused: nothing "
            "listens there" in lines
        )
        found = _probed(_check(cfg, "--probe", "--probe-seconds", "2", "--json"))
        assert found["held", "bound"]["state"] == "bind_failed"
        assert str(found["held", "bound"]["reason"]).startswith(
            f"cannot bind tcp://127.0.0.1:{held}: Address already in use (another process binds "
            "that port: a second kvobserve, or the scheduler"
        )

        target_port = _polled_sub(ctx, stop, threads)
        cfg = write_toml(
            tmp_path / "ok.toml", {"worker": [_bound_worker("llmd", port, target_port)]}
        )
        topics = [f"kv@127.0.0.{k}:8000@m{k}" for k in (2, 3)]
        for k, topic in zip((2, 3), topics, strict=True):
            sims.append(SimulatedWorker(SimConfig(
                worker_id=f"pod{k}", format="vllm-0.33", dp_size=1, topic=topic, rate=50,
                host=f"127.0.0.{k}", kv_connect=f"tcp://127.0.0.1:{port}", http_port=None,
                replay_port=None)).start())  # fmt: skip
        proc = _check(cfg, "--probe", "--probe-seconds", "3", "--json")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        found = _probed(proc)
        bound, relay = found["llmd", "bound"], found["llmd", "relay"]
        assert (bound["state"], bound["reason"], bound["publishers"]) == (
            "up",
            "receiving from 2 publisher(s)",
            2,
        )
        assert sorted(bound["topics"]) == topics  # type: ignore[call-overload]
        assert relay["ok"] and relay["reason"] == "reachable, subscribed to every topic"
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=5)
        for sim in sims:
            sim.stop()
        ctx.destroy(linger=0)
