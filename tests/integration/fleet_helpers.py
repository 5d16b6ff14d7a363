"""Shared helpers of the fleet acceptance tests: kvobserve processes, scrapes, TOML, polling."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from kvobserve.simulate import SimConfig

ROOT = Path(__file__).resolve().parents[2]
Labels = dict[str, str]


# --- processes ---------------------------------------------------------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without KVOBSERVE_* settings (they would override the test's config)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KVOBSERVE_") or k == "KVOBSERVE_COLLECTOR_STATE_DIR"  # the test's own
    }
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


@dataclass
class Procs:
    """kvobserve child processes of one test; each writes to its own log file; all stopped."""

    log_dir: Path
    started: list[tuple[subprocess.Popen[bytes], Path]] = field(default_factory=list)

    def spawn(self, name: str, argv: list[str], env: Mapping[str, str] | None = None) -> int:
        """Start `argv` (a file, not a pipe, takes its output); returns the PID."""
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=dict(env or clean_env()), cwd=ROOT
            )
        self.started.append((proc, log))
        return proc.pid

    def kvobserve(self, name: str, *args: str, env: Mapping[str, str] | None = None) -> int:
        """`python -m kvobserve ARGS...`."""
        return self.spawn(name, [sys.executable, "-m", "kvobserve", *args], env)

    def _find(self, pid: int) -> tuple[subprocess.Popen[bytes], Path]:
        return next((p, log) for p, log in self.started if p.pid == pid)

    def log(self, pid: int) -> str:
        """What the process printed so far."""
        return self._find(pid)[1].read_text(errors="replace")

    def alive(self, pid: int) -> bool:
        """Still running."""
        return self._find(pid)[0].poll() is None

    def terminate(self, pid: int, timeout_s: float = 5.0) -> tuple[int, float]:
        """SIGTERM by PID; (exit code, seconds until it exited). KILL after `timeout_s`."""
        proc = self._find(pid)[0]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
            raise AssertionError(f"pid {pid} ignored SIGTERM for {timeout_s} s") from None
        return rc, time.monotonic() - t0

    def kill(self, pid: int) -> None:
        """SIGKILL by PID (nothing of the process runs on: no shutdown), and reap it."""
        proc = self._find(pid)[0]
        proc.kill()
        proc.wait(timeout=5)

    def stop_all(self) -> None:
        """SIGTERM every process still running, then KILL what is left (teardown)."""
        for proc, _ in self.started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in self.started:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


# --- scraping ----------------------------------------------------------------------------------


@dataclass
class Scrape:
    """One parsed /metrics text: sample name -> [(labels, value)]."""

    samples: dict[str, list[tuple[Labels, float]]]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        """Parse with prometheus_client's own parser (a malformed exposition raises)."""
        out: dict[str, list[tuple[Labels, float]]] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out.setdefault(s.name, []).append((dict(s.labels), s.value))
        return cls(out)

    def get(self, name: str, **match: str) -> list[tuple[Labels, float]]:
        """Samples of `name` whose labels include `match`."""
        return [
            (lb, v)
            for lb, v in self.samples.get(name, [])
            if all(lb.get(k) == val for k, val in match.items())
        ]

    def by(self, name: str, keys: Iterable[str], **match: str) -> dict[tuple[str, ...], float]:
        """{label values of `keys`: value}; a repeated key is an assertion error."""
        keys = tuple(keys)
        out: dict[tuple[str, ...], float] = {}
        for lb, v in self.get(name, **match):
            k = tuple(lb.get(key, "") for key in keys)
            assert k not in out, f"{name}{dict(zip(keys, k, strict=True))} appears twice"
            out[k] = v
        return out


def fetch(url: str, timeout_s: float = 3.0) -> str | None:
    """GET `url` as text; None while nothing answers (a process still starting)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return str(r.read().decode())
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def scrape(base: str) -> Scrape | None:
    """`base`/metrics parsed; None while nothing answers."""
    text = fetch(f"{base}/metrics")
    return Scrape.parse(text) if text is not None else None


# --- config files ------------------------------------------------------------------------------


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # an inline table: `kubernetes = {selector = "app=vllm"}`
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"no TOML for {v!r}")


def toml_text(doc: Mapping[str, Any]) -> str:
    """A kvobserve.toml: top-level keys, [tables] and [[arrays of tables]] (one level deep)."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict | list)]
    for k, v in doc.items():
        if isinstance(v, dict):
            lines += ["", f"[{k}]", *(f"{kk} = {_toml_value(vv)}" for kk, vv in v.items())]
        elif isinstance(v, list):
            for table in v:
                lines += ["", f"[[{k}]]"]
                lines += [f"{kk} = {_toml_value(vv)}" for kk, vv in table.items()]
    return "\n".join(lines) + "\n"


def write_toml(path: Path, doc: Mapping[str, Any]) -> Path:
    """Write `doc` as TOML to `path`; returns the path."""
    path.write_text(toml_text(doc))
    return path


def worker_tables(plan: list[list[SimConfig]]) -> list[dict[str, Any]]:
    """One `[[worker]]` table per simulated worker (its first node's config), on 127.0.0.1."""
    workers: list[dict[str, Any]] = []
    for nodes in plan:
        c = nodes[0]
        w: dict[str, Any] = {
            "id": c.worker_id,
            "engine": c.wire.engine,
            "kv_endpoint": f"tcp://127.0.0.1:{c.kv_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{c.replay_port}",
            "dp_size": c.dp_size,
        }
        if c.topic:
            w["topic"] = c.topic
        if c.wire.engine == "sglang":
            w["dp_attention"] = True
        workers.append(w)
    return workers
