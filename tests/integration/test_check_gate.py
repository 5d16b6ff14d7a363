"""`kvobserve check` as a gate (issue 30): its exit codes, each with what it prints, run as a user
would run it, against simulated engines on 127.0.0.1 / 127.0.0.2.

0: the config is valid and the plan has no problem. 1: the plan has a problem that `kvobserve run`
would report (a node count the engine contradicts, an engine whose discovery does not answer, a
`relay_to` host that does not resolve): the plan it could make, then the problems. 2: the config
is wrong: one line on stderr and nothing else.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvobserve.simulate import SimConfig, SimulatorGroup, nodes_of
from kvobserve.simulate.ports import free_port, free_port_range
from tests.integration.fleet_helpers import ROOT, clean_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

HOSTS = ("127.0.0.1", "127.0.0.2")
HEAD = (
    "config (flags/env only): valid\n"
    "cluster default  collector box  node_rank 0 of {nnodes}  host 127.0.0.1\n"
    "http 127.0.0.1:9477 (run)  nats embedded\n"
)
NOT_CONTACTED = "\nendpoints not contacted: `kvobserve check --probe` connects to each\n"
UNRESOLVABLE = "a" * 64 + ".kvobserve"  # refused by the C library: no DNS query is sent


def check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvobserve", "check", "--collector-id", "box", *args],
        capture_output=True, text=True, timeout=60, env=clean_env(), cwd=ROOT,
    )  # fmt: skip


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[SimulatorGroup]:
    """A 2-node SGLang 0.5.23 engine, dp_size 4 with DP attention: ranks 0-1 on 127.0.0.1, 2-3
    on 127.0.0.2; node 0 serves the HTTP API (discovery)."""
    sim = SimConfig(
        format="sglang-0.5.23", dp_size=4, nnodes=2, rate=5.0, prompts=20,
        http_port=free_port_range(HOSTS, 1),
    )  # fmt: skip
    g = SimulatorGroup(nodes_of(sim, HOSTS)).start()
    try:
        yield g
    finally:
        g.stop()


def _streams(g: SimulatorGroup) -> str:
    node0 = g.workers[0]
    kv, rp = node0.kv_base, node0.replay_base
    return "".join(
        f" *{r:<8} {0:<5} {f'tcp://127.0.0.1:{kv + r}':<32} {f'tcp://127.0.0.1:{rp + r}':<32} ''\n"
        for r in (0, 1)
    )


def test_exit_0_when_the_plan_has_no_problem(two_nodes: SimulatorGroup) -> None:
    url = f"http://127.0.0.1:{two_nodes.workers[0].http_port}"
    proc = check("--engine", "sglang", "--engine-url", url, "--worker-id", "sg", "--nnodes", "2")
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout == (
        HEAD.format(nnodes=2)
        + f"\nworker sg (sglang, dp_size 4, DP attention, leader)  discovered from "
        f"{url}/server_info\n"
        "  dp_rank  node  endpoint                         replay                           topic\n"
        + _streams(two_nodes)
        + "  2-3      1     (node 1's collector connects to these)\n"
        "  ranks watched by this node (*): 0-1\n"
        "  probe endpoints: none\n"
        "  scheduler sources:\n"
        f"    metrics    {url + '/metrics':<40} (leader)\n" + NOT_CONTACTED
    )


def test_exit_1_when_the_engine_runs_on_more_nodes_than_configured(
    two_nodes: SimulatorGroup,
) -> None:
    """Issue 30 item 4: a layout that `run` raises as CRITICAL (nnodes 1 against a 2-node engine)
    was a note and exit 0."""
    url = f"http://127.0.0.1:{two_nodes.workers[0].http_port}"
    fix = (
        "the engine runs on 2 nodes, [collector] nnodes is 1; set [collector] nnodes = 2 and run "
        "a collector on each node"
    )
    proc = check("--engine", "sglang", "--engine-url", url, "--worker-id", "sg")
    assert (proc.returncode, proc.stderr) == (1, "")
    assert proc.stdout == (
        HEAD.format(nnodes=1)
        + f"\nworker sg (sglang, dp_size 4, DP attention, leader)  discovered from "
        f"{url}/server_info\n"
        f"  note: {fix}\n"
        "  dp_rank  node  endpoint                         replay                           topic\n"
        + _streams(two_nodes)
        + "  2-3      -     (not watched: the engine does not run them on this node)\n"
        "  ranks watched by this node (*): 0-1\n"
        "  probe endpoints: none\n"
        "  scheduler sources:\n"
        f"    metrics    {url + '/metrics':<40} (leader)\n" + NOT_CONTACTED + "\n"
        "problems (`kvobserve run` would report these):\n"
        f"  worker sg: layout_mismatch: {fix}\n"
    )


def test_exit_1_with_the_plan_when_discovery_does_not_answer() -> None:
    """Issue 30 item 4: an engine that does not answer made `check` print only the discovery
    error, with exit 2, the code of a syntax error."""
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    proc = check("--engine", "sglang", "--engine-url", url, "--worker-id", "sg")
    assert (proc.returncode, proc.stderr) == (1, "")
    assert proc.stdout == (
        HEAD.format(nnodes=1) + "\nworker sg (sglang, dp_size ?, leader)\n"
        f"  note: discovery {url}/server_info: connection: connection refused; no endpoint "
        "without it (the collector asks again every 30 s; or set kv_endpoint)\n"
        "  ranks watched by this node (*): none\n"
        "  probe endpoints: none\n"
        "  scheduler sources:\n"
        f"    metrics    {url + '/metrics':<40} (leader)\n" + NOT_CONTACTED + "\n"
        "problems (`kvobserve run` would report these):\n"
        f"  worker sg: worker_undiscovered: connection refused at {url}/server_info\n"
    )


def test_exit_1_when_the_relay_target_does_not_resolve() -> None:
    target = f"tcp://{UNRESOLVABLE}:5556"
    bind = f"tcp://127.0.0.1:{free_port()}"
    args = ("--engine", "vllm", "--bind", bind, "--relay-to", target, "--worker-id", "v")
    proc = check(*args)
    assert (proc.returncode, proc.stderr) == (1, "")
    assert proc.stdout.endswith(
        NOT_CONTACTED + "\nproblems (`kvobserve run` would report these):\n"
        f"  worker v: relay_to: cannot resolve {UNRESOLVABLE!r} in {target}: Name or service "
        "not known\n"
    )
    assert f" *0        {bind:<28} {'-':<28} {target}\n" in proc.stdout
    # --no-discovery contacts and resolves nothing: the file alone is checked
    proc = check(*args, "--no-discovery")
    assert (proc.returncode, proc.stderr) == (0, "") and "problems" not in proc.stdout


def test_exit_2_on_a_config_error_with_one_line_and_no_plan() -> None:
    proc = check("--engine", "sglang", "--engine-url", "http://127.0.0.1:1", "--nnodes", "2",
                 "--node-rank", "2")  # fmt: skip
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (
        "kvobserve check: error: --node-rank (collector.node_rank): 2 must be < --nnodes "
        "(collector.nnodes) (2)\n"
    )
