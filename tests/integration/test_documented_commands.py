"""Every `kvobserve` command line shown in README.md and docs/ runs, the way a user would type it.

Command lines are taken from fenced code blocks and from inline code spans with arguments. Hosts,
ports and files in them are mapped onto a real environment on 127.0.0.1 (a simulated SGLang
engine, a nats-server, a running `kvobserve run`, throwaway config files); a doc line this test
cannot map fails it, so the docs cannot drift from what the commands accept. Daemons must serve
(or print) and then stop on SIGTERM with exit 0; one-shot commands must succeed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import ssl
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvobserve.simulate import SimConfig, SimulatedWorker, SimulatorGroup
from kvobserve.simulate.ports import free_port, free_port_range
from tests.certs import self_signed
from tests.integration.conftest import NatsServer
from tests.integration.fleet_helpers import ROOT, Procs, clean_env, fetch, write_toml
from tests.integration.k8s_helpers import expand, lws_sidecar_env, lws_templates, shared_toml
from tests.integration.kube_api import serving_in_thread
from tests.integration.test_dynamo_source import expected, observed
from tests.polling import until

pytestmark = pytest.mark.integration

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMANDS = ("demo", "run", "collect", "aggregate", "simulate", "tap", "status", "check", "overlap")
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
    pods_config: Path  # a [worker.kubernetes] worker whose API server plays recorded pods
    bind: str  # where a simulated vLLM connects its publisher (vLLM given a concrete host)
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
        (r"tcp://127\.0\.0\.1:6657", f"tcp://127.0.0.1:{free_port()}"),  # and its replay port
        (r"--replay-port 6657", f"--replay-port {free_port()}"),
        (r"--bind tcp://\*:5557", f"--bind {env.bind}"),  # where a simulated vLLM connects
        (r"(0\.0\.0\.0):9477", listen),
        (r"tcp://(10\.0\.0\.5|127\.0\.0\.1):5657", env.replay),
        (r"tcp://(10\.0\.0\.5|127\.0\.0\.1):(5557|41230)|tcp://<host>:<port>|tcp://host:port", env.kv),
        (r"(?<= )(ENDPOINT|<endpoint>)", env.kv),
        (r"(?<= )HASH\b", "-8257400165350477486"),  # a block hash as tap prints it
        (r"--file frames\.jsonl", f"--file {CAPTURE}"),
        (r"--record frames\.jsonl", f"--record {env.recorded}"),
        (r"/etc/kvobserve/tls\.crt", env.cert),
        (r"/etc/kvobserve/tls\.key", env.key),
        (r"-c sim\.toml", f"-c {env.sim_config}"),
        (r"-c dynamo\.toml", f"-c {env.dynamo_config}"),
        (r"-c pods\.toml", f"-c {env.pods_config}"),
        (r"tcp://10\.0\.0\.5:36001", env.dynamo_zmq),
        (r"--engine-url http://(10\.0\.0\.5|127\.0\.0\.1):30000", f"--engine-url {env.engine_url}"),
        (r"--http-port 30000", "--http-port 0"),  # a simulated engine's HTTP port
        (r"127\.0\.0\.2:9478", f"127.0.0.2:{free_port()}"),  # node 1's collector, on its address
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

            def ready() -> bool:
                assert proc.poll() is None, f"exited {proc.returncode}:\n{out_path.read_text()}"
                return _ready(args, base, out_path)

            until(ready, 30, "ready", out_path.read_text)
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
    bind = f"tcp://127.0.0.1:{free_port()}"
    connecting = SimulatedWorker(
        SimConfig(worker_id="docs-connect", format="vllm-0.33", dp_size=1, topic="kv-events",
                  rate=20, kv_connect=bind, http_port=None, replay_port=None)
    ).start()  # fmt: skip
    pods = serving_in_thread()  # a Kubernetes API server with llm-d's pods (kube_api.py)
    pods_api = pods.__enter__()
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
        k8s = {"namespace": "llm-d", "selector": "llm-d.ai/inference-serving=true",
               "replay_port": 5559, "topic": "kv@{pod_ip}:8000@",
               "kubeconfig": str(pods_api.kubeconfig(tmp / "kubeconfig"))}  # fmt: skip
        pods_config = write_toml(
            tmp / "pods.toml", {"worker": [{"id": "qwen", "engine": "vllm", "kubernetes": k8s}]}
        )
        port = free_port()
        run = subprocess.Popen(
            [sys.executable, "-m", "kvobserve", "run", "-c", str(config), "--listen", f"127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=clean_env(), cwd=ROOT,
        )  # fmt: skip
        aggregator = f"http://127.0.0.1:{port}"

        def serving() -> bool:
            assert run.poll() is None, "kvobserve run exited"
            return _healthy(aggregator)

        until(serving, 30, "kvobserve run serves")
        cert, key = self_signed(tmp / "tls")
        yield Env(
            tmp, nats.url, kv, replay, url, config, sim_config, aggregator, cert, key,
            dynamo_config, dynamo_zmq, pods_config, bind,
        )  # fmt: skip
    finally:
        if run is not None:
            run.send_signal(signal.SIGTERM)
            run.wait(timeout=10)
        sim.stop()
        connecting.stop()
        dynamo.stop()
        nats.stop()
        pods.__exit__(None, None, None)


LINES = documented_lines()


def test_the_docs_show_command_lines() -> None:
    # The scan itself: a regression here would make the test below vacuous.
    assert len(LINES) >= 30
    assert {line.split()[1] for _, line in LINES if line.startswith("kvobserve")} >= set(COMMANDS)


def _pipeline(stages: list[tuple[list[str], dict[str, str]]], tmp: Path) -> str:
    """`kvobserve A | kvobserve B`: one-shot commands, each one's stdout the next one's stdin;
    what the last printed (stdout and stderr). Every stage must succeed."""
    procs: list[subprocess.Popen[bytes]] = []
    out_path = tmp / f"out-{time.monotonic_ns()}.log"
    with open(out_path, "wb") as out:
        stdin = None
        for i, (args, extra) in enumerate(stages):
            last = i == len(stages) - 1
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvobserve", *args], stdin=stdin,
                stdout=out if last else subprocess.PIPE, stderr=subprocess.STDOUT if last else None,
                env=clean_env(**extra), cwd=ROOT,
            )  # fmt: skip
            if stdin is not None:
                stdin.close()  # the next stage owns it now
            stdin = proc.stdout
            procs.append(proc)
        try:
            codes = [p.wait(timeout=60) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=5)
    text = out_path.read_text()
    assert codes == [0] * len(procs), f"exits {codes}:\n{text}"
    return text


@pytest.mark.parametrize(("where", "line"), LINES, ids=[f"{w}: {c}" for w, c in LINES])
def test_documented_command_line_runs(env: Env, where: str, line: str) -> None:
    if " | " in line:  # a pipeline of one-shot commands
        stages = [_map(stage, env) for stage in line.split(" | ")]
        assert all(base is None for _, _, base in stages), line
        text = _pipeline([(args, extra) for args, extra, _ in stages], env.tmp)
        args = stages[-1][0]
    else:
        args, extra, base = _map(line, env)
        text = _run(args, extra, base, env.tmp)
    if args[0] == "check":
        assert ": valid" in text
    elif args[0] == "status":
        assert "WORKER" in text and "docs" in text  # the table, with the running worker
    elif args[0] == "tap":
        assert ('"block_hashes"' if "--requests" in args else '"events"') in text
    elif args[0] == "overlap":
        assert "WORKER" in text and "docs" in text  # the table, with the running worker's ranks


# --- docs/deployment.md "One worker over several nodes", run as written, node 1's engine killed ---

PAGE = (ROOT / "docs" / "deployment.md").read_text()
SEVERAL = PAGE.split("## One worker over several nodes", 1)[1].split("\n## ", 1)[0]
SGLANG = SEVERAL.split("### SGLang: DP attention, dp_size 8 over 2 nodes", 1)[1].split("\n### ")[0]
NODES = ("127.0.0.1", "127.0.0.2")  # node 0 (10.0.0.5), node 1 (10.0.0.6): its own loopback
# Why a killed engine's stream is down: at once, then once ZMQ's reconnects are refused
GONE = ("disconnected: the publisher went away (engine stopped?)",
        "connection refused: nothing listens there")  # fmt: skip


def _walkthrough() -> tuple[str, str, list[dict[str, str]], str, str, str]:
    """(engine launch, config file, per-node environment, collect, aggregate, status) as the
    page shows them (a change there changes what this test runs)."""
    launch = re.search(r"```sh\n(python -m sglang\.launch_server .*?)```", SGLANG, re.S)
    config = re.search(r"```toml\n(.*?)```", SGLANG, re.S)
    envs = [
        dict(line.split("=", 1) for line in block.strip().splitlines())
        for block in re.findall(r"```sh\n((?:KVOBSERVE_\w+=\S+\n)+)```", SEVERAL)
    ]
    collect = re.search(r"\$ (kvobserve collect -c \S+)", SEVERAL)
    aggregate = re.search(r"`(kvobserve aggregate --nats URL [^`]+)`", PAGE)
    status = re.search(r"\$ (kvobserve status --url \S+ --events)", PAGE)
    assert launch and config and collect and aggregate and status and len(envs) == 2
    return (launch.group(1), config.group(1), envs, collect.group(1), aggregate.group(1),
            status.group(1))  # fmt: skip


def _simulate_args(launch: str, node_rank: int, ports: dict[int, int]) -> list[str]:
    """The documented SGLang launch on node `node_rank`, stood in for by `kvobserve simulate`
    with the same layout; documented ports mapped to free ones (`ports`)."""
    words = shlex.split(launch.replace("\\\n", " "))
    assert words[0] in ("python", "python3") and words[1:3] == ["-m", "sglang.launch_server"]
    opts = {w: words[i + 1] for i, w in enumerate(words) if w.startswith("--") and i + 1 < len(words) and not words[i + 1].startswith("--")}  # fmt: skip
    kv = json.loads(opts["--kv-events-config"])
    kv_port = int(kv["endpoint"].rsplit(":", 1)[1])
    dp = int(opts["--dp-size"])
    assert "--enable-metrics" in words  # what every node's metrics_url reads
    load = opts.get("--load-publish-endpoint")
    assert load in (None, "auto"), load
    return [
        "simulate", "--format", "sglang-0.5.23", "--dp-size", str(dp),
        "--nnodes", opts["--nnodes"], "--node-rank", str(node_rank), "--host", NODES[node_rank],
        "--http-port", str(ports[int(opts["--port"])]), "--kv-port", str(ports[kv_port]),
        "--replay-port", str(ports[int(kv["replay_endpoint"].rsplit(":", 1)[1])]),
        *(["--load-port", str(ports[kv_port] + dp)] if load else []),  # `auto`: KV base + dp
        "--topic", kv["topic"], "--rate", "20",
        *([] if "--enable-dp-attention" in words else ["--no-dp-attention"]),
    ]  # fmt: skip


def _status(argv: list[str]) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "kvobserve", *argv], capture_output=True, text=True, timeout=30,
        env=clean_env(), cwd=ROOT,
    )  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


def test_two_node_walkthrough_with_node_1s_engine_killed(tmp_path: Path) -> None:
    """The SGLang walkthrough of docs/deployment.md on 127.0.0.1 (node 0) and 127.0.0.2 (node 1):
    8 ranks up with usage; then node 1's engine is killed and `kvobserve status` shows ranks 4-7
    down with the reason, no cache or token usage, and exits 1."""
    launch, config, envs, collect, aggregate, status = _walkthrough()
    kv = free_port_range(NODES, 17)  # 8 ranks, the port past them, 8 load PUBs (`auto`)
    ports = {
        5557: kv,
        5657: free_port_range(NODES, 9, avoid=(kv,)),
        30000: free_port_range(NODES, 1, avoid=(kv,)),
    }
    nats = NatsServer(tmp_path / "js")
    nats.start()
    procs = Procs(tmp_path)

    def logs() -> str:
        return "\n".join(f"--- {p.args}\n{log.read_text()[-1500:]}" for p, log in procs.started)

    def doc(text: str) -> str:  # the page's addresses and ports onto this machine
        for a, b in (("10.0.0.5", NODES[0]), ("10.0.0.6", NODES[1]),
                     ("nats://10.0.0.9:4222", nats.url), (":30000", f":{ports[30000]}")):  # fmt: skip
            text = text.replace(a, b)
        return text

    agg = f"127.0.0.1:{free_port()}"
    try:
        engines = [
            procs.kvobserve(f"engine-{k}", *_simulate_args(launch, k, ports)) for k in (0, 1)
        ]
        for pid in engines:
            until(lambda pid=pid: "ready workers=" in procs.log(pid), 30, "engine ready", logs)
        cfg = tmp_path / "kvobserve.toml"
        cfg.write_text(doc(config))
        argv = doc(aggregate).replace("--nats URL", f"--nats {nats.url}")
        argv = argv.replace("--cluster NAME", "--cluster prod-a").replace("0.0.0.0:9477", agg)
        procs.kvobserve("aggregate", *shlex.split(argv)[1:])
        for k, env in enumerate(envs):
            procs.kvobserve(
                f"collect-{k}",
                *shlex.split(collect.replace("/etc/kvobserve/kvobserve.toml", str(cfg)))[1:],
                # the node's environment; this machine's stand-ins for node k's own address
                # and its local HTTP port
                env=clean_env(
                    **env,
                    KVOBSERVE_COLLECTOR_HOST=NODES[k],
                    KVOBSERVE_HTTP_LISTEN=f"{NODES[k]}:{free_port()}",
                ),
            )
        status_argv = shlex.split(status.replace("127.0.0.1:9477", agg))[1:]

        def fleet_up() -> bool:
            rc, text = _status(status_argv)
            rows = [ln.split() for ln in text.splitlines() if ln.startswith("sglang-dp8 ")]
            return rc == 0 and len(rows) == 8 and all(r[4] == "up" and r[12] != "-" for r in rows)

        until(fleet_up, 60, "8 ranks up with cache usage, exit 0", logs)
        assert "8/8 streams up" in _status(status_argv)[1]

        os.kill(engines[1], signal.SIGKILL)  # by PID: node 1's engine dies, its collector runs on
        until(lambda: not procs.alive(engines[1]), 10, "engine 1 gone", logs)

        def dead_shown() -> str | None:
            rc, text = _status(status_argv)
            down = [ln for ln in text.splitlines() if "stream_down" in ln and "CRITICAL" in ln]
            return text if rc == 1 and len(down) == 4 else None

        text = until(dead_shown, 30, "ranks 4-7 down in `kvobserve status`, exit 1", logs)
        rows = {int(ln.split()[1]): ln for ln in text.splitlines() if ln.startswith("sglang-dp8 ")}
        for r in range(4, 8):
            cells = rows[r].split()
            assert cells[2] == "1" and cells[4] != "up", rows[r]
            assert cells[12:14] == ["-", "-"], rows[r]  # no cache usage, no token usage
            assert rows[r].endswith(GONE), rows[r]  # the reason
            why = f"sglang-dp8 rank {r} is down: connecting: ({'|'.join(map(re.escape, GONE))})"
            assert re.search(rf"CRITICAL stream_down .*dp_rank={r}\b.*: {why}", text), text
        for r in range(4):  # node 0 is untouched
            cells = rows[r].split()
            assert cells[4] == "up" and cells[12].endswith("%"), rows[r]
        assert "4/8 streams up" in text and "cache_near_full" not in text, text
        head = text.splitlines()[0].split()
        assert head[12:15] == ["USAGE", "TOKEN_USAGE", "REASON"], head
    finally:
        procs.stop_all()
        nats.stop()


# --- docs/deployment.md's sidecar and Dynamo sections: their files run as the sections say ------

SIDECAR = PAGE.split("## Kubernetes: a collector sidecar in every engine pod", 1)[1].split("\n## ")[
    0
]
DYNAMO = PAGE.split("## NVIDIA Dynamo: its event plane", 1)[1].split("\n## ", 1)[0]


def _blocks(section: str) -> tuple[str, str]:
    """(the engine's launch: the first plain code block, the kvobserve file) of a section."""
    launch = re.search(r"```\n(.*?)```", section, re.S)
    config = re.search(r"```toml\n(.*?)```", section, re.S)
    assert launch and config, "a section shows the engine's flags and kvobserve's file"
    return launch.group(1), config.group(1)


def test_sidecar_section_is_the_manifests_and_runs_in_each_lws_pod(tmp_path: Path) -> None:
    """The sidecar section shows deploy/kubernetes' engine flags and shared file. Run as
    deployed, each LWS pod on its own loopback address with the environment the manifests give
    its sidecar, then the aggregator: 8 ranks up, each owned by the pod that runs it, with a
    cache usage from that pod's own engine."""
    launch, config = _blocks(SIDECAR)
    (engine,) = lws_templates()["leader"]["spec"]["containers"]
    assert shlex.split(launch.replace("\\\n", " ")) == [*engine["command"], *engine["args"]]
    assert tomllib.loads(config) == shared_toml()
    collect = re.search(r"`(kvobserve collect -c \S+)`", SIDECAR)
    aggregate = re.search(r"`(kvobserve aggregate -c \S+)`", SIDECAR)
    assert collect and aggregate
    base = free_port_range(NODES, 19)  # 8 ranks and the port past them, their replay, HTTP
    ports = {5557: base, 5657: base + 9, 30000: base + 18}
    cfg = tmp_path / "kvobserve.toml"
    cfg.write_text(re.sub(r":(5557|5657|30000)\b", lambda m: f":{ports[int(m[1])]}", config))
    nats = NatsServer(tmp_path / "js")
    nats.start()
    procs = Procs(tmp_path)
    agg = f"127.0.0.1:{free_port()}"

    def logs() -> str:
        return "\n".join(f"--- {p.args}\n{log.read_text()[-1500:]}" for p, log in procs.started)

    try:
        for k in (0, 1):  # the leader pod, the worker pod
            pod, env = lws_sidecar_env(0, k)
            lws = {n: v for n, v in env.items() if n.startswith("LWS_")}
            sim = procs.kvobserve(f"engine-{k}", *_simulate_args(expand(launch, lws), k, ports))
            until(lambda sim=sim: "ready workers=" in procs.log(sim), 30, f"{pod}'s engine", logs)
            mine = {n: v for n, v in env.items() if n.startswith("KVOBSERVE_")}
            # the pod's emptyDir at /var/lib/kvobserve: here the test's own directory
            mine.update(KVOBSERVE_NATS_URL=nats.url, KVOBSERVE_COLLECTOR_HOST=NODES[k],
                        KVOBSERVE_HTTP_LISTEN=f"{NODES[k]}:{free_port()}",
                        KVOBSERVE_COLLECTOR_STATE_DIR=str(tmp_path / f"state-{k}"))  # fmt: skip
            argv = shlex.split(collect[1].replace("/etc/kvobserve/kvobserve.toml", str(cfg)))
            procs.kvobserve(f"collect-{k}", *argv[1:], env=clean_env(**mine))
        argv = shlex.split(aggregate[1].replace("/etc/kvobserve/kvobserve.toml", str(cfg)))
        procs.kvobserve("aggregate", *argv[1:],
                        env=clean_env(KVOBSERVE_NATS_URL=nats.url, KVOBSERVE_HTTP_LISTEN=agg))  # fmt: skip

        def rows() -> dict[int, list[str]] | None:
            rc, text = _status(["status", "--url", agg])
            found = {int(ln.split()[1]): ln.split() for ln in text.splitlines()
                     if ln.startswith("sglang-dp8-0 ")}  # fmt: skip
            ok = rc == 0 and len(found) == 8
            return (
                found if ok and all(r[4] == "up" and r[12] != "-" for r in found.values()) else None
            )

        found = until(rows, 60, "8 ranks up, each with its cache usage", logs)
        for rank, cells in found.items():  # NODE, COLLECTOR: the pod that runs the rank
            k = rank // 4
            assert cells[2:4] == [str(k), lws_sidecar_env(0, k)[0]], cells
    finally:
        procs.stop_all()
        nats.stop()


def test_dynamo_section_runs_against_simulated_dynamo_workers(tmp_path: Path) -> None:
    """The Dynamo section: the workers' environment and flags agree with kvobserve's file, which
    `kvobserve run` reads as shown while a simulated Dynamo worker publishes on NATS in the
    documented namespace: every stream exact against the simulator's truth, tokens counted in
    the engine's blocks."""
    launch, config = _blocks(DYNAMO)
    lines = launch.replace("\\\n", " ").splitlines()
    exports = dict(w.split("=", 1) for w in shlex.split(lines[0])[1:])
    words = shlex.split(next(ln for ln in lines if "-m dynamo.sglang" in ln))
    opts = {w: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("--")}
    (worker,) = tomllib.loads(config)["worker"]
    assert exports["DYN_EVENT_PLANE"] == "nats" and worker["engine"] == "dynamo"
    assert worker["event_plane_url"] == exports["NATS_SERVER"]
    assert worker["block_size"] == int(opts["--page-size"])
    run = re.search(r"\$ (kvobserve run -c dynamo\.toml)\n", DYNAMO)
    assert run and json.loads(opts["--kv-events-config"])["publisher"] == "zmq"
    nats = NatsServer(tmp_path / "js", jetstream=False)
    nats.start()
    procs = Procs(tmp_path)
    group = None
    try:
        group = SimulatorGroup([SimConfig(
            worker_id="dyn", format="sglang-0.5.23", dp_size=1, event_plane="nats",
            event_plane_url=nats.url, namespace=worker["namespace"],
            page_size=worker["block_size"], rate=300.0, max_batches=60, start_delay_s=600.0,
            side_interval_s=0.2, http_port=None, replay_port=None, prompts=40,
        )]).start()  # fmt: skip
        (tmp_path / "dynamo.toml").write_text(config.replace(exports["NATS_SERVER"], nats.url))
        listen = f"127.0.0.1:{free_port()}"
        env = clean_env(KVOBSERVE_HTTP_LISTEN=listen)
        argv = shlex.split(run[1].replace("dynamo.toml", str(tmp_path / "dynamo.toml")))
        pid = procs.spawn("run", [sys.executable, "-m", *argv], env)
        base = f"http://{listen}"

        def streams() -> list[dict[str, Any]]:
            return [s for s in json.loads(fetch(f"{base}/api/v1/streams") or "[]")
                    if s["engine"] == "dynamo"]  # fmt: skip

        def beating() -> bool:  # the rank's load heartbeat came: subscribed, events may start
            text = fetch(f"{base}/api/v1/fleet")
            workers = json.loads(text)["workers"] if text else []
            return any(w["worker_id"].startswith("dynamo/") and w["owners"] for w in workers)

        until(beating, 30, "the Dynamo worker's heartbeat", lambda: procs.log(pid))
        for w in group.dynamo:
            w.publish_now()
        until(lambda: all(w._finished() for w in group.dynamo), 30, "the simulator published")
        want = expected(group.truth())
        until(lambda: observed(streams(), set()) == want, 30, "streams equal the truth",
             lambda: f"{observed(streams(), set())}\n!=\n{want}")  # fmt: skip
        (s,) = streams()
        assert s["blocks"]["GPU"] > 0
        assert s["tokens"]["GPU"] == s["blocks"]["GPU"] * worker["block_size"]
    finally:
        procs.stop_all()
        if group is not None:
            group.stop()
        nats.stop()
