"""Acceptance (issue 28): kvobserve's own restarts lose nothing, with rings shorter than history.

An SGLang 0.5.23 and a vLLM 0.33 engine (the simulator's bytes) run on two loopback nodes
(127.0.0.1, 127.0.0.2), busy, each rank's replay ring holding fewer batches than it has published:
a collector that starts over from an empty index could only join mid-stream. `kvobserve collect`
on node 1 checkpoints its streams every second; it is stopped with SIGTERM, started again 10 s
later, then killed with SIGKILL and started again 10 s later. Each time, within 5 s of its start
(plus one checkpoint interval after SIGKILL) every rank of node 1 has resumed from its checkpoint
and caught up from its ring: what it missed counted as recovered, nothing lost; then, the engines
held still, its resident blocks equal the engine's truth. The same for `kvobserve run` on one
node. Down for longer than a ring of 200 batches holds: no usage, blocks or tokens while the
index cannot vouch for them, a lower bound, the reason in /api/v1/streams and `status`, and the
warning condition past `unvouched_warn_s`. What the processes report is read where an operator
reads it: the aggregator's /api/v1/streams, /metrics, /api/v1/alerts and `kvobserve status`.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvobserve.export.api import every_alert
from kvobserve.simulate import SimConfig, SimulatorGroup, nodes_of
from kvobserve.simulate.ports import free_port
from tests.integration.conftest import NatsServer
from tests.integration.fleet_helpers import Procs, clean_env, write_toml
from tests.polling import until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]

HOSTS = ("127.0.0.1", "127.0.0.2")
RATE = 50.0  # batches per second and rank
RING = 800  # replay ring (batches): 16 s of history, more than 10 s down, less than the run
DOWN_S = 10.0
CHECKPOINT_S = 1.0
ENGINES = {
    "sg": SimConfig(format="sglang-0.5.23", dp_size=4, nnodes=2, topic="kv-events", rate=RATE,
                    max_batches=100_000, buffer_steps=RING, prompts=40, start_delay_s=0.0,
                    replay_port=0, http_port=None, seed=1),
    "vl": SimConfig(format="vllm-0.33", dp_size=4, nnodes=2, rate=RATE, max_batches=100_000,
                    buffer_steps=RING, prompts=40, start_delay_s=0.0, replay_port=0,
                    http_port=None, seed=2),
}  # fmt: skip


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.stop_all()


@pytest.fixture
def engines() -> Iterator[dict[str, SimulatorGroup]]:
    groups: dict[str, SimulatorGroup] = {}
    try:
        for wid, cfg in ENGINES.items():
            groups[wid] = SimulatorGroup(nodes_of(dataclasses.replace(cfg, worker_id=wid), HOSTS))
            groups[wid].start()
        yield groups
    finally:
        for g in groups.values():
            g.stop()


def _workers(groups: dict[str, SimulatorGroup]) -> list[dict[str, Any]]:
    """Both engines, every rank at its own node (a wildcard host: each collector its own)."""
    out = []
    for wid, g in groups.items():
        w0 = g.workers[0]
        doc: dict[str, Any] = {
            "id": wid, "engine": w0.fmt.engine, "dp_size": 4,
            "kv_endpoint": f"tcp://*:{w0.kv_base}",
            "replay_endpoint": f"tcp://*:{w0.replay_base}",
        }  # fmt: skip
        if w0.cfg.topic:
            doc["topic"] = w0.cfg.topic
        if w0.fmt.engine == "sglang":
            doc["dp_attention"] = True
        out.append(doc)
    return out


def _streams(base: str) -> dict[tuple[str, int], dict[str, Any]]:
    """/api/v1/streams by (worker_id, dp_rank)."""
    with urllib.request.urlopen(f"{base}/api/v1/streams", timeout=5.0) as r:
        doc = json.load(r)
    return {(s["worker_id"], s["dp_rank"]): s for s in doc}


def _wait(what: str, timeout_s: float, check: Any) -> Any:
    """The suite's poll (tests/polling.py), named first: these waits read as sentences."""
    return until(check, timeout_s, what)


def _resumed(base: str, ranks: list[tuple[str, int]]) -> dict[Any, Any]:
    """Every rank of `ranks` up in a restarted process (it recovered what it missed)."""

    def check() -> dict[Any, Any] | None:
        try:
            s = _streams(base)
        except OSError:
            return None
        got = {k: s.get(k) for k in ranks}
        ok = all(
            x is not None and x["up"] and x["recovered"] > 0 and not x["replay_requests"].get(
                "timeout") and x["trust"] in ("complete", "replay_filled")
            for x in got.values()
        )  # fmt: skip
        return got if ok else None

    return _wait("node 1's ranks resumed from their checkpoints", 30.0, check)


def _held_still_and_exact(groups: dict[str, SimulatorGroup], base: str,
                          ranks: list[tuple[str, int]]) -> None:  # fmt: skip
    """Hold the engines; once the collectors applied everything, their blocks are the truth."""
    for g in groups.values():
        for w in g.workers:
            w.pause()
    try:
        truth: dict[tuple[str, int], int] = {}
        for wid, g in groups.items():
            for w in g.workers:
                for rank, st in w.truth()["ranks"].items():
                    inst = [i for i in st["instances"] if i["kind"] == "primary"][-1]
                    truth[(wid, int(rank))] = sum(len(h) for h in inst["resident"].values())

        def exact() -> bool:
            s = _streams(base)
            return all(sum(s[k]["blocks"].values()) == truth[k] for k in ranks)

        _wait("node 1's blocks equal the engines' truth", 20.0, exact)
        s = _streams(base)
        for k in ranks:
            assert (s[k]["lost"], s[k]["restarts"], s[k]["vouched"]) == (0, 0, True), s[k]
    finally:
        for g in groups.values():
            for w in g.workers:
                w.resume()


def _env() -> dict[str, str]:
    """The processes' environment without the suite's own state_dir: these tests name theirs in
    the config, and KVOBSERVE_COLLECTOR_STATE_DIR would override it."""
    env = clean_env()
    env.pop("KVOBSERVE_COLLECTOR_STATE_DIR", None)
    return env


def test_a_collector_stopped_or_killed_resumes_exactly(
    engines: dict[str, SimulatorGroup], procs: Procs, nats_server: NatsServer, tmp_path: Path
) -> None:
    http = free_port()
    procs.kvobserve("aggregate", "aggregate", "--nats", nats_server.url, "--listen",
                    f"127.0.0.1:{http}", "--cluster", "restarts")  # fmt: skip
    base = f"http://127.0.0.1:{http}"
    configs = [
        write_toml(
            tmp_path / f"node-{k}.toml",
            {
                "cluster": "restarts",
                "collector": {
                    "id": f"node-{k}",
                    "node_rank": k,
                    "nnodes": 2,
                    "host": HOSTS[k],
                    "interval_s": 0.5,
                    "state_dir": str(tmp_path / f"state-{k}"),
                    "checkpoint_interval_s": CHECKPOINT_S,
                },
                "worker": _workers(engines),
                "nats": {"url": nats_server.url},
            },
        )
        for k in (0, 1)
    ]
    env = _env()
    procs.kvobserve("collect-0", "collect", "-c", str(configs[0]), "--no-local-http", env=env)
    node1 = procs.kvobserve("collect-1", "collect", "-c", str(configs[1]), "--no-local-http",
                            env=env)  # fmt: skip
    ranks = [(w, r) for w in ENGINES for r in (2, 3)]  # node 1's
    # the engines' history outgrows their rings before anything restarts
    _wait("history longer than the rings", 60.0, lambda: all(
        w.rank(r).streams[-1].seq > RING for g in engines.values() for w in g.workers
        for r in w.cfg.hosted_ranks()))  # fmt: skip
    _wait("node 1 streams up and checkpointed", 30.0, lambda: all(
        x["up"] for k, x in _streams(base).items() if k in ranks) and len(list(
        (tmp_path / "state-1").rglob("*.ckpt"))) == len(ranks))  # fmt: skip
    going_on = 0.0
    for how in ("SIGTERM", "SIGKILL"):
        if how == "SIGTERM":
            rc, took = procs.terminate(node1)
            assert rc == 0 and took < 3.0, (rc, took)
        else:
            # SIGKILL leaves each stream's last round: the restarted process has written one
            # since the engines went on (a loaded machine may take a few seconds to)
            files = list((tmp_path / "state-1").rglob("*.ckpt"))
            _wait("a checkpoint round after the resume", 30.0,
                  lambda t=going_on, f=files: all(p.stat().st_mtime > t for p in f))  # fmt: skip
            procs.kill(node1)
        time.sleep(DOWN_S)  # down for 10 s: the engines go on publishing
        started = time.monotonic()
        node1 = procs.kvobserve(f"collect-1-{how}", "collect", "-c", str(configs[1]),
                                "--no-local-http", env=env)  # fmt: skip
        _resumed(base, ranks)
        took = time.monotonic() - started
        bound = 5.0 + (CHECKPOINT_S if how == "SIGKILL" else 0.0)
        print(f"\n{how}: node 1's ranks resumed {took:.2f} s after the start (bound {bound} s)")
        assert took <= bound, f"{how}: resumed {took:.1f} s after the start, bound {bound} s"
        _held_still_and_exact(engines, base, ranks)
        going_on = time.time()
        log = procs.log(node1)
        assert log.count("restored") >= len(ranks), log[-2000:]


def test_kvobserve_run_on_one_node_resumes_exactly(procs: Procs, tmp_path: Path) -> None:
    groups: dict[str, SimulatorGroup] = {}
    try:
        for wid, cfg in ENGINES.items():
            one = dataclasses.replace(cfg, worker_id=wid, nnodes=1, dp_size=2)
            groups[wid] = SimulatorGroup(nodes_of(one, HOSTS[:1])).start()
        http = free_port()
        workers = _workers(groups)
        for w in workers:
            w["dp_size"] = 2
        cfg = write_toml(tmp_path / "run.toml", {
            "cluster": "run",
            "collector": {"id": "one", "interval_s": 0.5, "state_dir": str(tmp_path / "state"),
                          "checkpoint_interval_s": CHECKPOINT_S},
            "http": {"listen": f"127.0.0.1:{http}"},
            "worker": workers,
        })  # fmt: skip
        base = f"http://127.0.0.1:{http}"
        ranks = [(w, r) for w in ENGINES for r in (0, 1)]
        pid = procs.kvobserve("run", "run", "-c", str(cfg), env=_env())
        _wait("history longer than the rings", 60.0, lambda: all(
            w.rank(r).streams[-1].seq > RING for g in groups.values() for w in g.workers
            for r in w.cfg.hosted_ranks()))  # fmt: skip
        _wait("checkpointed", 30.0, lambda: len(list((tmp_path / "state").rglob("*.ckpt")))
              == len(ranks))  # fmt: skip
        rc, _ = procs.terminate(pid)
        assert rc == 0
        time.sleep(DOWN_S)  # down for 10 s
        started = time.monotonic()
        procs.kvobserve("run-again", "run", "-c", str(cfg), env=_env())
        _resumed(base, ranks)
        took = time.monotonic() - started
        print(f"\nrun: resumed {took:.2f} s after the start (bound 5 s)")
        assert took <= 5.0
        _held_still_and_exact(groups, base, ranks)
    finally:
        for g in groups.values():
            g.stop()


def test_down_longer_than_the_ring_serves_no_number_it_cannot_vouch_for_and_warns(
    procs: Procs, tmp_path: Path
) -> None:
    """Issue 28: `kvobserve run` down for longer than a ring of 200 batches holds. The rejoined
    ranks serve no usage, blocks or tokens while their index cannot vouch for them (a lower
    bound under its own name, the reason in /api/v1/streams and `status`); once a busy engine
    has evicted every block from before the join, the index fills the engine's capacity and
    vouches: exact again (tests/unit/test_vouch.py). A rank that cannot vouch in time raises the
    warning condition: here, as the engine's hot prefixes never leave."""
    ring, rate = 200, 50.0  # 4 s of history
    one = dataclasses.replace(ENGINES["vl"], worker_id="vl", nnodes=1, dp_size=2,
                              buffer_steps=ring, rate=rate, seed=5)  # fmt: skip
    group = SimulatorGroup(nodes_of(one, HOSTS[:1])).start()
    try:
        http = free_port()
        workers = _workers({"vl": group})
        workers[0].update(dp_size=2, capacity_tokens=one.capacity_tokens)
        cfg = write_toml(tmp_path / "run.toml", {
            "cluster": "ring",
            "collector": {"id": "one", "interval_s": 0.5, "state_dir": str(tmp_path / "state"),
                          "checkpoint_interval_s": CHECKPOINT_S},
            "aggregator": {"unvouched_warn_s": 5},
            "http": {"listen": f"127.0.0.1:{http}"},
            "worker": workers,
        })  # fmt: skip
        base = f"http://127.0.0.1:{http}"
        ranks = [("vl", r) for r in (0, 1)]
        w = group.workers[0]
        pid = procs.kvobserve("run", "run", "-c", str(cfg), env=_env())
        _wait("checkpointed", 30.0, lambda: len(list((tmp_path / "state").rglob("*.ckpt")))
              == len(ranks))  # fmt: skip
        rc, _ = procs.terminate(pid)
        assert rc == 0
        left_at = {r: w.rank(r).streams[-1].seq for _, r in ranks}
        _wait("the rings no longer reach the checkpoints", 60.0, lambda: all(
            w.rank(r).streams[-1].seq > left_at[r] + 2 * ring for _, r in ranks))  # fmt: skip
        procs.kvobserve("run-again", "run", "-c", str(cfg), env=_env())

        def unvouched() -> dict[Any, Any] | None:
            try:
                s = _streams(base)
            except OSError:
                return None
            got = {k: s.get(k) for k in ranks}
            ok = all(x is not None and x["up"] and x["unvouched"] for x in got.values())
            return got if ok else None

        got = _wait("both ranks up and unvouched", 30.0, unvouched)
        for x in got.values():
            assert x["lost"] > 0 and x["blocks"] == {} and x["cache_usage_ratio"] is None, x
            assert x["unvouched"]["reason"] and x["unvouched"]["lower_bound"]["blocks"] >= 0, x
        with urllib.request.urlopen(f"{base}/metrics", timeout=5.0) as r:
            metrics = r.read().decode()
        for line in metrics.splitlines():
            if line.startswith(("kvobserve_kv_cache_usage_ratio{", "kvobserve_kv_blocks{")):
                assert 'worker_id="vl"' not in line, line
        assert 'kvobserve_kv_index_unvouched{dp_rank="0",node_rank="0",worker_id="vl"} 1' in (
            metrics
        ), metrics
        status = subprocess.run(
            [sys.executable, "-m", "kvobserve", "status", "--url", base], capture_output=True,
            text=True, timeout=30, env=_env(), cwd=ROOT,
        )  # fmt: skip
        assert "cache not seen whole (" in status.stdout and "tokens resident" in status.stdout, (
            status.stdout
        )

        # The simulator's engine reuses its prompts' prefixes: hot blocks from before the loss
        # stay resident and never leave the index, so it cannot show that nothing extra is
        # left (tests/unit/test_vouch.py has the indexes that vouch again by the engine's
        # capacity): past `unvouched_warn_s` that is a warning condition with its runbook.
        def warned() -> list[dict[str, Any]] | None:
            with urllib.request.urlopen(f"{base}/api/v1/alerts", timeout=5.0) as r:
                alerts: list[dict[str, Any]] = json.load(r)
            # under its cause (the lost batches: one cause, one entry), or on its own
            got = [a for a in every_alert(alerts) if a["kind"] == "index_incomplete"]
            return got if len(got) == len(ranks) else None

        got_alerts = _wait("index_incomplete for both ranks", 30.0, warned)
        for a in got_alerts:
            assert (a["severity"], a["alert"]) == ("warning", "KVIndexIncomplete"), a
            assert "kvobserve cannot see this rank's cache" in a["description"], a
            assert "tokens are resident" in a["description"], a
    finally:
        group.stop()
