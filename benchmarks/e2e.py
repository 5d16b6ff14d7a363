"""End-to-end latency: a batch published on ZMQ until its count shows in the aggregator's /metrics.

Run: `python -m benchmarks.e2e [--samples 50]`. A real nats-server, `kvobserve collect`
(snapshot interval 1 s) and `kvobserve aggregate` run as subprocesses; this process binds the
engine's PUB socket, publishes one batch at a random phase of the snapshot interval, and polls
the aggregator's /metrics every 10 ms until kvobserve_kv_event_batches_total has counted it.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import msgspec
import zmq

from benchmarks._common import (
    NatsServer,
    free_port,
    median,
    percentile,
    stop_process,
    wait_for_port,
)

POLL_S = 0.01
COUNTER = b"kvobserve_kv_event_batches_total{"


def batches_total(url: str) -> float | None:
    """The stream's kvobserve_kv_event_batches_total in one scrape, if served."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        for line in resp.read().splitlines():
            if line.startswith(COUNTER):
                return float(line.rsplit(b" ", 1)[1])
    return None


def payload(seq: int) -> bytes:
    """One batch: a BlockStored of 16 fresh hashes (SGLang 0.5.23 map form)."""
    hashes = [seq * 16 + i for i in range(16)]
    ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
          "token_ids": list(range(256)), "block_size": 16, "lora_id": None, "medium": "GPU"}  # fmt: skip
    return msgspec.msgpack.encode([time.time(), [ev], 0])


def wait_for_count(url: str, want: float, deadline_s: float) -> float:
    """Poll until the counter reaches `want`; the monotonic time it was seen."""
    end = time.monotonic() + deadline_s
    while True:
        got = None
        with contextlib.suppress(OSError):  # the aggregator is still starting
            got = batches_total(url)
        if got is not None and got >= want:
            return time.monotonic()
        if time.monotonic() > end:
            raise TimeoutError(f"batches_total {got} after {deadline_s} s, wanted {want}")
        time.sleep(POLL_S)  # polling interval


def run(samples: int, interval: float, workdir: Path) -> list[float]:
    """Latencies (seconds) of `samples` batches."""
    kv, http, local = free_port(), free_port(), free_port()
    cfg = workdir / "collector.toml"
    cfg.write_text(
        f'cluster = "e2e"\n[collector]\nid = "node-0"\ninterval_s = {interval}\n'
        f'[http]\nlisten = "127.0.0.1:{local}"\n'
        '[[worker]]\nid = "bench"\nengine = "sglang"\ndp_size = 1\nprobe_extra_ports = 0\n'
        f'kv_endpoint = "tcp://127.0.0.1:{kv}"\ntopic = "kv-events"\n'
    )
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{kv}")
    procs: list[subprocess.Popen[bytes]] = []
    url = f"http://127.0.0.1:{http}/metrics"
    latencies: list[float] = []
    with NatsServer(workdir / "nats.log") as srv, open(workdir / "procs.log", "wb") as logf:
        try:
            for cmd in (
                [
                    "aggregate",
                    "--nats",
                    srv.url,
                    "--cluster",
                    "e2e",
                    "--listen",
                    f"127.0.0.1:{http}",
                ],
                ["collect", "-c", str(cfg), "--nats", srv.url, "--no-local-http"],
            ):
                procs.append(
                    subprocess.Popen([sys.executable, "-m", "kvobserve", *cmd], stdout=logf,
                                     stderr=subprocess.STDOUT)
                )  # fmt: skip
            wait_for_port(http, 20)
            # warm-up: seq 0 until it is counted (the SUB connects late; repeats are duplicates)
            first = payload(0)
            end = time.monotonic() + 30
            while (batches_total(url) or 0) < 1:
                if time.monotonic() > end:
                    raise TimeoutError("the first batch never showed up in /metrics")
                pub.send_multipart([b"kv-events", (0).to_bytes(8, "big"), first])
                time.sleep(0.2)  # polling interval
            rng = random.Random(3)
            for seq in range(1, samples + 1):
                time.sleep(rng.uniform(0, interval))  # a random phase of the snapshot interval
                t0 = time.monotonic()
                pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), payload(seq)])
                latencies.append(wait_for_count(url, seq + 1, 10 * interval + 5) - t0)
        finally:
            for p in reversed(procs):
                stop_process(p)
            ctx.destroy(linger=0)
    return latencies


def main(argv: list[str] | None = None) -> int:
    """Print p50/p99 latency; returns 0."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=__doc__)
    p.add_argument("--samples", type=int, default=50)
    p.add_argument("--interval", type=float, default=1.0, help="collector snapshot interval (s)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvobserve-e2e-") as tmp:
        lat = run(args.samples, args.interval, Path(tmp))
    print(
        f"publish -> aggregator /metrics through nats-server, interval {args.interval} s, "
        f"{len(lat)} samples: p50 {1e3 * median(lat):.0f} ms, p99 {1e3 * percentile(lat, 0.99):.0f}"
        f" ms, max {1e3 * max(lat):.0f} ms (poll every {POLL_S * 1e3:.0f} ms)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
