"""Run the docker-compose topology without Docker: each service as a local process on 127.0.0.1.

Every port a service lists under `expose:` gets a free port (or a free range) on 127.0.0.1; every
`host:port` of a service and every `0.0.0.0:port` is rewritten to it, in the services' commands
and in test copies of the files they mount. Images map to local binaries (IMAGES).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from kvobserve.simulate.ports import free_port, free_port_range
from tests.integration.conftest import nats_server_binary
from tests.polling import until

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
T = TypeVar("T")

# image (without tag) -> local command; services of other images (grafana) are not run.
IMAGES: dict[str, Callable[[], list[str]]] = {
    "nats": lambda: [nats_server_binary()],
    "prom/prometheus": lambda: [_which("prometheus")],
    "prom/alertmanager": lambda: [_which("prometheus-alertmanager")],
    "kvobserve": lambda: [str(Path(sys.executable).parent / "kvobserve")],
}
# What an image does without being told (its CMD/defaults), made explicit for 127.0.0.1.
IMAGE_DEFAULT_ARGS: dict[str, Callable[[PortMap, str], list[str]]] = {
    "nats": lambda ports, svc: ["-a", "127.0.0.1", "-p", str(ports.port(svc, 4222))],
}


def _which(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise AssertionError(f"{name} not on PATH: run scripts/install-tools.sh")
    return found


def load_compose(path: Path = COMPOSE) -> dict[str, Any]:
    """The compose file as a dict (YAML merge keys resolved)."""
    with path.open() as f:
        doc: dict[str, Any] = yaml.safe_load(f)
    return doc


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose variable interpolation: ${VAR}, ${VAR:-default}, ${VAR-default}."""

    def repl(m: re.Match[str]) -> str:
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}", repl, value)


class PortMap:
    """(service, container port) -> a free port on 127.0.0.1; ranges keep their offsets."""

    def __init__(self, services: dict[str, Any]) -> None:
        self.map: dict[tuple[str, int], int] = {}
        for name, svc in services.items():
            for item in svc.get("expose", []):
                lo, _, hi = str(item).partition("-")
                first, last = int(lo), int(hi or lo)
                base = (
                    free_port_range("127.0.0.1", last - first + 1) if last > first else free_port()
                )
                for p in range(first, last + 1):
                    self.map[(name, p)] = base + p - first

    def port(self, service: str, port: int) -> int:
        """The local port standing in for `service:port`."""
        try:
            return self.map[(service, port)]
        except KeyError:
            raise AssertionError(f"{service}:{port} is not under `expose:` of {service}") from None

    def rewrite(self, text: str, own: str | None = None) -> str:
        """Every `service:port` (and, for `own`, `0.0.0.0:port`) -> `127.0.0.1:local`."""
        for (svc, p), local in self.map.items():
            text = re.sub(rf"(?<![\w.-]){re.escape(svc)}:{p}(?!\d)", f"127.0.0.1:{local}", text)
            if svc == own:
                text = re.sub(rf"0\.0\.0\.0:{p}(?!\d)", f"127.0.0.1:{local}", text)
        return text


class Stack:
    """The compose services as processes; `start(name)` one at a time, `stop()` all by PID."""

    def __init__(
        self,
        workdir: Path,
        env: dict[str, str] | None = None,
        edit: Callable[[Path, str], str] | None = None,
        compose: dict[str, Any] | None = None,
    ) -> None:
        self.compose = compose or load_compose()
        self.services: dict[str, Any] = self.compose["services"]
        self.workdir = workdir
        self.env = env or {}
        self.edit = edit or (lambda _path, text: text)  # a test's changes to a mounted file
        self.ports = PortMap(self.services)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        self._copying: set[Path] = set()

    def url(self, service: str, port: int, path: str = "") -> str:
        """http://127.0.0.1:<local port of service:port><path>"""
        return f"http://127.0.0.1:{self.ports.port(service, port)}{path}"

    def image(self, service: str) -> str:
        """The service's image name without tag."""
        return str(self.services[service]["image"]).rsplit(":", 1)[0]

    def _host_path(self, service: str, container_path: str) -> Path | None:
        """Where a container path of the service lives here: repo file, test copy or temp dir."""
        for vol in self.services[service].get("volumes", []):
            src, dst = str(vol).split(":")[:2]
            if container_path != dst and not container_path.startswith(dst.rstrip("/") + "/"):
                continue
            rest = container_path[len(dst) :].lstrip("/")
            if not src.startswith((".", "/")):  # a named volume: a fresh directory per stack
                d = self.workdir / "volumes" / src / rest
                d.mkdir(parents=True, exist_ok=True)
                return d
            return self._copy((ROOT / src / rest).resolve(), service)
        return None

    def _copy(self, src: Path, service: str) -> Path:
        """A test copy of a mounted file with host names and ports rewritten (and `edit` applied)."""
        if not src.is_file() or src in self._copying:  # a file naming itself: left as is
            return src
        self._copying.add(src)
        dst = self.workdir / "files" / service / src.relative_to(ROOT)
        dst.parent.mkdir(parents=True, exist_ok=True)
        text = self.ports.rewrite(src.read_text(), own=service)
        for vol in self.services[service].get("volumes", []):
            # a path inside the container named in the file (prometheus.yml's rule_files)
            mount = str(vol).split(":")[1]
            pattern = rf"(?<![\w./-]){re.escape(mount)}(?:/[\w.-]+)*"
            text = re.sub(pattern, lambda m: str(self._host_path(service, m.group(0))), text)
        dst.write_text(self.edit(src, text))
        self._copying.discard(src)
        return dst

    def command(self, service: str) -> list[str]:
        """The service's compose `command:` made local: paths, hosts, ports and variables."""
        svc = self.services[service]
        args = [interpolate(str(a), self.env) for a in svc.get("command", [])]
        out: list[str] = []
        own_ports = {p for (s, p) in self.ports.map if s == service}
        for i, arg in enumerate(args):
            flag, eq, value = (
                arg.partition("=") if arg.startswith("-") and "=" in arg else ("", "", arg)
            )
            if value.startswith("/") and (host := self._host_path(service, value)) is not None:
                value = str(host)
            value = self.ports.rewrite(value, own=service)
            prev = args[i - 1] if i else ""
            if value.isdigit() and int(value) in own_ports and prev.startswith("-"):
                value = str(self.ports.port(service, int(value)))  # --kv-port 5557, -m 8222
            if value == "0.0.0.0":
                value = "127.0.0.1"
            out.append(f"{flag}{eq}{value}" if eq else value)
        image = self.image(service)
        defaults = IMAGE_DEFAULT_ARGS.get(image)
        return [*IMAGES[image](), *(defaults(self.ports, service) if defaults else []), *out]

    def start(self, service: str) -> None:
        """Start one service; its output goes to a log file."""
        cmd = self.command(service)
        log = self.workdir / "logs" / f"{service}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        self.logs[service] = log
        with log.open("ab") as f:
            f.write(("$ " + " ".join(cmd) + "\n").encode())
            f.flush()
            self.procs[service] = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, cwd=self.workdir, env=_child_env()
            )

    def check_running(self) -> None:
        """Fail, with the log tail, if a started service has exited."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited with {proc.returncode}\n{self.tail(name)}")

    def tail(self, service: str, lines: int = 30) -> str:
        """The last lines of a service's log."""
        path = self.logs.get(service)
        if path is None or not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def until(self, check: Callable[[], T], timeout_s: float, what: str) -> T:
        """`tests.polling.until` while every started service runs (one that exits fails the
        wait at once); a service not answering yet is a falsy value; logs in the message."""

        def running_check() -> T:
            self.check_running()
            return check()

        return until(
            running_check, timeout_s, what, self.all_tails, retry_on=(OSError, ValueError),
            interval_s=0.25,
        )  # fmt: skip

    def all_tails(self) -> str:
        """Log tails of every started service, for failure messages."""
        return "\n".join(f"--- {n}\n{self.tail(n, 15)}" for n in self.procs)

    def stop(self) -> None:
        """Stop every started service by its PID: TERM, then KILL after 5 s."""
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def _child_env() -> dict[str, str]:
    """The environment without KVOBSERVE_* settings that would change the services' config."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KVOBSERVE_") or k == "KVOBSERVE_COLLECTOR_STATE_DIR"  # the test's own
    }


def http_json(url: str, params: dict[str, str] | None = None, timeout: float = 5.0) -> Any:
    """GET a JSON document."""
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.load(resp)


def scale_for(rules_text: str, factor: float) -> str:
    """The rules file with every `for:` and `keep_firing_for:` divided by `factor`; expressions
    untouched."""
    doc = yaml.safe_load(rules_text)
    for group in doc["groups"]:
        for rule in group["rules"]:
            for key in ("for", "keep_firing_for"):
                if key in rule:
                    rule[key] = f"{round(parse_duration(rule[key]) * 1000 / factor)}ms"
    return str(yaml.safe_dump(doc, sort_keys=False))


def parse_duration(text: str) -> float:
    """A Prometheus duration (`2m`, `1h30m`, `500ms`) in seconds."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    parts = re.findall(r"(\d+)(ms|[smhdwy])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return sum(int(n) * units[u] for n, u in parts)
