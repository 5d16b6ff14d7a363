"""Every `kvobserve` command line shown in README.md and docs/ runs, the way a user would type it.

Command lines are taken from fenced code blocks and from inline code spans with arguments. Hosts,
ports and files in them are mapped onto a real environment on 127.0.0.1 (a simulated SGLang
engine, a nats-server, a running `kvobserve run`, throwaway config files); a doc line this test
cannot map fails it, so the docs cannot drift from what the commands accept. Daemons must serve
(or print) and then stop on SIGTERM with exit 0; one-shot commands must succeed.
"""

from __future__ import annotations

import re
import shlex
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvobserve.simulate import SimConfig, SimulatedWorker, SimulatorGroup
from tests.certs import self_signed
from tests.integration.conftest import NatsServer, free_port
from tests.integration.fleet_helpers import ROOT, clean_env, write_toml

pytestmark = pytest.mark.integration

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMANDS = ("demo", "run", "collect", "aggregate", "simulate", "tap", "status", "check")
CAPTURE = ROOT / "tests/fixtures/engine-captures/vllm-0.33.0/frames.jsonl"


def documented_lines() -> list[tuple[str, str]]:
    """(where, command line) for every kvobserve command line in the docs, in order, once each."""
    found: dict[str, str] = {}
    for path in DOCS:
        text = path.read_text()
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            lines = block.split("\n")
            for i, raw in enumerate(lines):
                line = raw.strip().removeprefix("$ ")
                while line.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line[:-1] + " " + lines[i].strip()
                line = re.sub(r"\s+#.*$", "", line)  # a trailing shell comment
                if re.match(r"^(\w+=\S+ )*kvobserve \w+", line) and ": error:" not in line:
                    found.setdefault(line, f"{path.name} (code block)")
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for span in re.findall(r"`(kvobserve [^`]+)`", prose):
            words = span.split()
            if ": error:" in span or words[1] not in COMMANDS:
                continue
            if len(words) > 2 or words[1] == "demo":  # a bare command name is a reference
                found.setdefault(span, f"{path.name} (inline)")
    return [(where, line) for line, where in found.items()]


@dataclass
class Env:
    """The real things a documented command line is pointed at."""

    tmp: Path
    nats: str
    kv: str  # rank 0's KV-event endpoint of the simulated engine
    replay: str
    engine_url: str
    config: Path  # a config that watches the engine and names the NATS server
    sim_config: Path
    aggregator: str  # base URL of a running `kvobserve run`
    cert: str
    key: str
    dynamo_config: Path  # a Dynamo plane on `nats`, where a simulated Dynamo worker publishes
    dynamo_zmq: str  # a ZMQ direct KV-event publisher of a simulated Dynamo worker
    recorded: Path = field(init=False)

    def __post_init__(self) -> None:
        self.recorded = self.tmp / "frames.jsonl"


def _map(line: str, env: Env) -> tuple[list[str], dict[str, str], str | None]:
    """(argv after `kvobserve`, extra environment, the HTTP base URL it should serve on)."""
    listen = f"127.0.0.1:{free_port()}"
    extra = {"KVOBSERVE_HTTP_LISTEN": listen}  # default ports (9477, 9478) may be in use here
    subs: list[tuple[str, str]] = [
        (r"\[(--[^\]]+)\]", r"\1"),  # optional flags: give them
        (r"--count N", "--count 1"),
        (r"--timeout S", "--timeout 10"),
        (r"collect …", "collect -c kvobserve.toml"),
        (r"\s*…$|\s*\[flags\]", ""),
        (r"\$\{KVOBSERVE_PROFILE:-(\w+)\}", r"\1"),
        (r"nats://(broker|nats|10\.0\.0\.\d+|127\.0\.0\.1):4222", env.nats),
        (r"--nats URL", f"--nats {env.nats}"),
        (r"--url (URL|(http://)?(localhost|<aggregator>|127\.0\.0\.1):947[78])", f"--url {env.aggregator}"),
        (r"--cluster NAME", "--cluster prod-a"),
        (r"tcp://127\.0\.0\.1:6557", f"tcp://127.0.0.1:{free_port()}"),  # bind mode's port
        (r"(0\.0\.0\.0):9477", listen),
        (r"tcp://(10\.0\.0\.5|127\.0\.0\.1):5657", env.replay),
        (r"tcp://(10\.0\.0\.5|127\.0\.0\.1):(5557|41230)|tcp://<host>:<port>|tcp://host:port", env.kv),
        (r"(?<= )(ENDPOINT|<endpoint>)", env.kv),
        (r"--file frames\.jsonl", f"--file {CAPTURE}"),
        (r"--record frames\.jsonl", f"--record {env.recorded}"),
        (r"/etc/kvobserve/tls\.crt", env.cert),
        (r"/etc/kvobserve/tls\.key", env.key),
        (r"-c sim\.toml", f"-c {env.sim_config}"),
        (r"-c dynamo\.toml", f"-c {env.dynamo_config}"),
        (r"tcp://10\.0\.0\.5:36001", env.dynamo_zmq),
        (r"-c (kvobserve\.toml|node-?[N0-9]\.toml|node\.toml|FILE|/etc/kvobserve/[\w.-]+\.toml)", f"-c {env.config}"),
    ]  # fmt: skip
    for pattern, repl in subs:
        line = re.sub(pattern, repl, line)
    words = shlex.split(line)
    while "=" in words[0]:  # VAR=value kvobserve ...: the documented environment
        name, _, value = words.pop(0).partition("=")
        extra[name] = "s3cret" if value in ("…", "...") else value
    leftover = re.findall(r"<[^>]+>|\b[A-Z]{3,}\b|…|10\.0\.0\.\d+|broker", shlex.join(words))
    assert not leftover, f"{line!r}: no mapping for {leftover} in test_documented_commands.py"
    assert words[0] == "kvobserve", line
    args = words[1:]
    for flag in ("--listen", "--collector-listen", "--aggregator-listen"):
        if flag in args:
            listen = args[args.index(flag) + 1]
    scheme = "https" if "--tls-cert" in args else "http"
    serves = args[0] in ("demo", "run", "collect", "aggregate")
    return args, extra, f"{scheme}://{listen}" if serves else None


def _healthy(base: str) -> bool:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        with urllib.request.urlopen(f"{base}/healthz", timeout=2, context=ctx) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _run(args: list[str], extra: dict[str, str], base: str | None, tmp: Path) -> str:
    """Run one command line; returns what it printed. Asserts on its behaviour."""
    out_path = tmp / f"out-{time.monotonic_ns()}.log"
    daemon = (
        base is not None
        or args[0] == "simulate"
        or (args[0] == "tap" and "--file" not in args and "--count" not in args)
    )
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvobserve", *args],
            stdout=out, stderr=subprocess.STDOUT, env=clean_env(**extra), cwd=ROOT,
        )  # fmt: skip
        try:
            if not daemon:
                rc = proc.wait(timeout=60)
                text = out_path.read_text()
                assert rc == 0 or (args[0] == "status" and rc == 1), f"exit {rc}:\n{text}"
                return text
            deadline = time.monotonic() + 30
            while not _ready(args, base, out_path):
                assert proc.poll() is None, f"exited {proc.returncode}:\n{out_path.read_text()}"
                assert time.monotonic() < deadline, f"not ready in 30 s:\n{out_path.read_text()}"
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=5)
            assert rc == 0, f"exit {rc} on SIGTERM:\n{out_path.read_text()}"
            return out_path.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=5)


def _ready(args: list[str], base: str | None, out: Path) -> bool:
    if base is not None:
        return _healthy(base)
    text = out.read_text(errors="replace")
    if args[0] == "simulate":
        return "ready workers=" in text
    return '"events"' in text  # a live tap printed a batch


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("documented")
    nats = NatsServer(tmp / "js")
    nats.start()
    sim = SimulatedWorker(
        SimConfig(worker_id="docs", format="sglang-0.5.23", dp_size=2, topic="kv-events", rate=20)
    ).start()
    dynamo = SimulatorGroup(
        [
            SimConfig(worker_id="docs-nats", event_plane="nats", event_plane_url=nats.url, rate=20),
            SimConfig(worker_id="docs-zmq", event_plane="zmq", rate=20),
        ]
    ).start()
    run = None
    try:
        kv, replay = f"tcp://127.0.0.1:{sim.kv_base}", f"tcp://127.0.0.1:{sim.replay_base}"
        url = f"http://127.0.0.1:{sim.http_port}"
        worker = {"id": "docs", "engine": "sglang", "kv_endpoint": kv, "replay_endpoint": replay,
                  "topic": "kv-events", "dp_size": 2, "dp_attention": True,
                  "metrics_url": f"{url}/metrics"}  # fmt: skip
        config = write_toml(
            tmp / "kvobserve.toml",
            {"cluster": "prod-a", "collector": {"interval_s": 0.5}, "worker": [worker],
             "nats": {"url": nats.url}},
        )  # fmt: skip
        sim_config = write_toml(tmp / "sim.toml", {"worker": [{"id": "s", "dp_size": 1}]})
        dyn_worker = {"engine": "dynamo", "event_plane_url": nats.url, "namespace": "dynamo",
                      "block_size": 16}  # fmt: skip
        dynamo_config = write_toml(tmp / "dynamo.toml", {"worker": [dyn_worker]})
        dynamo_zmq = next(e.url for e in dynamo.endpoints() if e.kind == "dynamo_kv")
        port = free_port()
        run = subprocess.Popen(
            [sys.executable, "-m", "kvobserve", "run", "-c", str(config), "--listen", f"127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=clean_env(), cwd=ROOT,
        )  # fmt: skip
        aggregator = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while not _healthy(aggregator):
            assert run.poll() is None and time.monotonic() < deadline, "kvobserve run did not serve"
            time.sleep(0.1)
        cert, key = self_signed(tmp / "tls")
        yield Env(
            tmp, nats.url, kv, replay, url, config, sim_config, aggregator, cert, key,
            dynamo_config, dynamo_zmq,
        )  # fmt: skip
    finally:
        if run is not None:
            run.send_signal(signal.SIGTERM)
            run.wait(timeout=10)
        sim.stop()
        dynamo.stop()
        nats.stop()


LINES = documented_lines()


def test_the_docs_show_command_lines() -> None:
    # The scan itself: a regression here would make the test below vacuous.
    assert len(LINES) >= 30
    assert {line.split()[1] for _, line in LINES if line.startswith("kvobserve")} >= set(COMMANDS)


@pytest.mark.parametrize(("where", "line"), LINES, ids=[f"{w}: {c}" for w, c in LINES])
def test_documented_command_line_runs(env: Env, where: str, line: str) -> None:
    args, extra, base = _map(line, env)
    text = _run(args, extra, base, env.tmp)
    if args[0] == "check":
        assert ": valid" in text
    elif args[0] == "status":
        assert "WORKER" in text and "docs" in text  # the table, with the running worker
    elif args[0] == "tap":
        assert '"events"' in text
