"""SIGTERM ends every kvobserve process within 2 s with exit 0 and frees its ports; the in-process
objects (SimulatedWorker, IngestLoop, Collector, Embedded) leave no thread and no listening socket.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvobserve.simulate.ports import free_port
from tests.integration.conftest import NatsServer
from tests.integration.fleet_helpers import ROOT, Procs, fetch, write_toml
from tests.polling import until

pytestmark = pytest.mark.integration


# --- listening sockets, from /proc ---------------------------------------------------------------


def _socket_inodes(pid: int | str) -> set[str]:
    out = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            link = os.readlink(f"{fd_dir}/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            out.add(link[8:-1])
    return out


def _listening() -> dict[str, int]:
    """inode -> port of every TCP socket in LISTEN state on this host (namespace)."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if parts[3] == "0A":  # TCP_LISTEN
                    out[parts[9]] = int(parts[1].rsplit(":", 1)[1], 16)
    return out


def listening_ports(pid: int | str = "self") -> set[int]:
    """Ports process `pid` listens on (its aiohttp servers and bound ZMQ sockets)."""
    inodes = _socket_inodes(pid)
    return {port for inode, port in _listening().items() if inode in inodes}


def os_threads() -> int:
    """Threads of this process, native ones (ZMQ I/O, reaper) included."""
    return len(os.listdir("/proc/self/task"))


# --- every command: SIGTERM within 2 s, exit 0, ports freed ----------------------------------------


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.stop_all()


def _healthy(base: str) -> Callable[[], bool]:
    return lambda: fetch(f"{base}/healthz") is not None


def _start(name: str, procs: Procs, tmp_path: Path, request: pytest.FixtureRequest) -> int:
    """Start `kvobserve NAME` and wait until it is doing its job; returns the PID."""
    port, kv = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    worker = {"id": "w", "engine": "vllm", "kv_endpoint": f"tcp://127.0.0.1:{kv}", "dp_size": 1}
    if name in ("collect", "aggregate"):
        nats: NatsServer = request.getfixturevalue("nats_server")
    if name == "run":
        cfg = write_toml(tmp_path / "run.toml", {"collector": {"interval_s": 0.2}, "worker": [worker],
                                                 "http": {"listen": f"127.0.0.1:{port}"}})  # fmt: skip
        pid = procs.kvobserve(name, "run", "-c", str(cfg))
        until(_healthy(base), 20, "run serves", lambda: procs.log(pid))
    elif name == "collect":
        cfg = write_toml(tmp_path / "c.toml", {"http": {"listen": f"127.0.0.1:{port}"},
                                               "worker": [worker], "nats": {"url": nats.url}})  # fmt: skip
        pid = procs.kvobserve(name, "collect", "-c", str(cfg))
        until(_healthy(base), 20, "collect serves", lambda: procs.log(pid))
    elif name == "aggregate":
        pid = procs.kvobserve(
            name, "aggregate", "--nats", nats.url, "--listen", f"127.0.0.1:{port}"
        )
        until(_healthy(base), 20, "aggregate serves", lambda: procs.log(pid))
    elif name == "demo":
        pid = procs.kvobserve(name, "demo", "--listen", f"127.0.0.1:{port}", "--duration", "60")
        until(lambda: "kvobserve_stream_up" in (fetch(f"{base}/metrics") or ""), 20, "demo")
    elif name == "simulate":
        pid = procs.kvobserve(name, "simulate", "--format", "sglang-0.5.23", "--dp-size", "2",
                              "--load-port", "0")  # fmt: skip
        until(lambda: "ready workers=1" in procs.log(pid), 20, "simulate ready")
    else:  # tap: ready once its SUB subscribed to our XPUB
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        xpub = ctx.socket(zmq.XPUB)
        try:
            xport = xpub.bind_to_random_port("tcp://127.0.0.1")
            pid = procs.kvobserve(name, "tap", f"tcp://127.0.0.1:{xport}")
            assert xpub.poll(20_000), procs.log(pid)
            assert xpub.recv()[:1] == b"\x01"
        finally:
            ctx.destroy(linger=0)
    return pid


@pytest.mark.parametrize("name", ["run", "collect", "aggregate", "simulate", "demo", "tap"])
def test_sigterm_ends_the_command_within_2_s_and_frees_its_ports(
    name: str, procs: Procs, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    pid = _start(name, procs, tmp_path, request)
    ports = listening_ports(pid)
    if name != "tap":  # tap only connects
        assert ports, f"{name} listens on nothing?"
    rc, took = procs.terminate(pid)
    assert rc == 0, procs.log(pid)
    assert took < 2.0, f"{name} took {took:.2f} s after SIGTERM"
    assert not ports & set(_listening().values()), f"{name}: still listening on {ports}"
    if name in STOPPING:  # the daemons say, once, that they stop and what they close (issue 30)
        said = [ln.split(" INFO ", 1)[-1] for ln in procs.log(pid).splitlines() if "SIGTERM" in ln]
        assert said == [f"kvobserve.commands.{name}: SIGTERM: stopping: {STOPPING[name]}"]


STOPPING = {
    "run": "closing HTTP, the collector (1 worker) and the aggregator (at most 2 s)",
    "collect": "closing HTTP, the collector and the NATS connection (at most 2 s)",
    "aggregate": "closing HTTP and the NATS connection (at most 2 s)",
}


# --- in-process objects: no thread, no native (ZMQ) thread, no listener left --------------------

CHILD = "from tests.integration.test_shutdown import child_main; child_main()"


def test_in_process_objects_leave_no_threads_or_listening_sockets() -> None:
    # In a fresh interpreter: threads another test left (a ZMQ context singleton, an executor)
    # would otherwise hide ours.
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.splitlines()[-1])
    assert report == {k: {"threads": [], "native_threads": 0, "listening": []} for k in report}
    assert set(report) == {"SimulatedWorker", "IngestLoop", "Collector", "Embedded"}


def _leftovers(before: tuple[set[threading.Thread], int, set[int]]) -> dict[str, Any]:
    """What is still there, polled for up to 2 s (threads end asynchronously)."""
    threads0, native0, ports0 = before
    end = time.monotonic() + 2.0
    while True:
        left = {
            "threads": sorted(t.name for t in set(threading.enumerate()) - threads0),
            "native_threads": max(0, os_threads() - native0),
            "listening": sorted(listening_ports() - ports0),
        }
        if not any(left.values()) or time.monotonic() > end:
            return left
        time.sleep(0.02)  # polling interval, not synchronization


def _baseline() -> tuple[set[threading.Thread], int, set[int]]:
    return set(threading.enumerate()), os_threads(), listening_ports()


def child_main() -> None:
    """Start and stop each object; print {object: leftovers} as JSON."""
    from kvobserve.commands.embedded import start_embedded
    from kvobserve.config import load_config
    from kvobserve.simulate import SimConfig, SimulatedWorker
    from kvobserve.sources.kv_stream import IngestLoop
    from kvobserve.sources.plan import StreamSpec

    report: dict[str, Any] = {}
    b = _baseline()
    sim = SimulatedWorker(SimConfig(format="sglang-0.5.23", dp_size=2, load_port=0, rate=200))
    sim.start()
    assert len(listening_ports() - b[2]) == 7  # 2 PUB, 2 ROUTER, 2 load PUB, HTTP
    sim.stop()
    report["SimulatedWorker"] = _leftovers(b)

    b = _baseline()
    loop = IngestLoop(
        [StreamSpec("w", r, "vllm", f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
         for r in (0, 1)]
    )  # fmt: skip
    loop.start()
    loop.stats().result(timeout=5)
    loop.stop()
    report["IngestLoop"] = _leftovers(b)

    port = free_port()
    o = {"worker.engine": "sglang", "worker.kv_endpoint": f"tcp://127.0.0.1:{free_port()}",
         "worker.dp_size": 2, "worker.load_endpoint": f"tcp://127.0.0.1:{free_port()}",
         "worker.kv_metrics_endpoint": f"tcp://127.0.0.1:{free_port()}",
         "worker.metrics_url": f"http://127.0.0.1:{free_port()}/metrics",
         "collector.interval_s": 0.1, "http.listen": f"127.0.0.1:{port}"}  # fmt: skip
    cfg = load_config(None, o, {})

    async def collector() -> None:
        from kvobserve.collector import Collector
        from kvobserve.transport.local import LocalBus

        bus = LocalBus()
        col = Collector(cfg, bus)
        await col.start()
        assert col.scheduler, "the scheduler sources (load SUB, KvMetrics PULL, scrape) run"
        await col.publish_once()
        await col.close()
        await bus.close()

    b = _baseline()
    asyncio.run(collector())
    report["Collector"] = _leftovers(b)

    async def embedded() -> None:
        emb = await start_embedded([cfg], cfg.http)
        assert port in listening_ports()
        await emb.close()

    b = _baseline()
    asyncio.run(embedded())
    report["Embedded"] = _leftovers(b)
    print(json.dumps(report))
