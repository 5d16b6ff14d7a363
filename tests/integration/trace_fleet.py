"""The trace on a two-node pool over NATS, as the live miss split and capacity tests run it:
`kvobserve simulate --trace`, two `kvobserve collect` and `kvobserve aggregate` as processes,
their endpoints read off the simulator's output and the engines' truth off its file."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HOSTS = ("127.0.0.1", "127.0.0.2")  # node 0 (ranks 0-1), node 1 (ranks 2-3)
POOL = "trace"


def spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "kvobserve", *argv], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT
        )


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = resp.read().decode()
    return json.loads(body) if "/api/" in url else body


def read_truth(path: Path) -> dict[str, Any] | None:
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc


def endpoints(log: Path, deadline: float) -> dict[str, str]:
    """kind (kv0 .. kv3, http) -> url, from the simulator's `endpoint` lines."""
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if "ready" in text:
            out = {}
            for line in text.splitlines():
                if line.startswith("endpoint "):
                    f = dict(p.split("=", 1) for p in line.split()[1:])
                    out[f["kind"] + (f["dp_rank"] if f["kind"] == "kv" else "")] = f["url"]
            return out
        time.sleep(0.1)  # polling the simulator's output for its endpoints, with a deadline
    raise TimeoutError(f"the simulator did not start: {log.read_text()}")


def collector_toml(path: Path, node: int, kv: str, http: str, nats_url: str) -> Path:
    port = kv.rsplit(":", 1)[1]
    path.write_text(
        f'cluster = "t"\n[collector]\nid = "node-{node}"\nnode_rank = {node}\nnnodes = 2\n'
        f'interval_s = 1.0\nhost = "{HOSTS[node]}"\n[http]\nlisten = ""\n'
        f'[nats]\nurl = "{nats_url}"\n'
        f'[[worker]]\nid = "{POOL}"\nengine = "sglang"\ndp_size = 4\ndp_attention = true\n'
        f'kv_endpoint = "tcp://*:{port}"\nprobe_extra_ports = 0\nmetrics_url = "{http}/metrics"\n'
    )
    return path
