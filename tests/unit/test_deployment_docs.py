"""docs/deployment.md "One worker over several nodes": every file loads with each node's environment.

The files are read out of the page itself, with the per-node environment blocks next to them, by
kvobserve's own loader; the plans they give each node and the `kvobserve check` output the page
shows are computed from what the simulated engine of that launch advertises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
from pathlib import Path

import pytest

from kvobserve.commands.check import _print_text, http_listens, plan_json
from kvobserve.config import COLLECT_DEFAULTS, Config, load_config
from kvobserve.simulate import SimConfig, SimulatedWorker
from kvobserve.simulate.discovery import kv_event_sources, server_info
from kvobserve.sources.discovery_parse import (
    DiscoveredEngine,
    merge,
    parse_sglang_server_info,
    parse_vllm_kv_event_sources,
)
from kvobserve.sources.plan import WorkerPlan, plan_worker

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "deployment.md").read_text()
SECTION = PAGE.split("## One worker over several nodes", 1)[1].split("\n## ", 1)[0]
FILES = re.findall(r"```toml\n(.*?)```", SECTION, re.S)
ENVS = [
    dict(line.split("=", 1) for line in block.strip().splitlines())
    for block in re.findall(r"```sh\n((?:KVOBSERVE_\w+=\S+\n)+)```", SECTION)
]
NODE_HOSTS = ("10.0.0.5", "10.0.0.6")


def _load(tmp_path: Path, text: str, env: dict[str, str]) -> Config:
    path = tmp_path / "kvobserve.toml"
    path.write_text(text)
    return load_config(str(path), {}, env)


def _sim(fmt: str, dp_size: int, port: int, **kw: object) -> SimulatedWorker:
    """The documented launch as the simulator answers for it (never started: no socket)."""
    cfg = SimConfig(
        worker_id="doc", format=fmt, dp_size=dp_size, nnodes=2, topic="kv-events", kv_port=5557,
        replay_port=5657, http_port=port, **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    return SimulatedWorker(cfg)


def _advertised(cfg: Config) -> DiscoveredEngine | None:
    """What the engine at the worker's URL(s) answers, per the documented launch."""
    w = cfg.workers[0]
    if not w.urls:
        return None
    if w.engine == "sglang":
        sim = _sim("sglang-0.5.23", 8, 30000, load_port=5565)
        return parse_sglang_server_info(f"{w.urls[0]}/server_info", server_info(sim))
    lb = "hybrid" if len(w.urls) > 1 else "internal"
    found = []
    for k, url in enumerate(w.urls):  # API server k runs on node k
        sim = _sim("vllm-0.33", 4, 8000, dp_lb=lb, node_rank=k)
        found.append(parse_vllm_kv_event_sources(f"{url}/kv_event_sources", kv_event_sources(sim)))
    return merge(found)


def _plans(tmp_path: Path, text: str) -> list[tuple[Config, WorkerPlan]]:
    out = []
    for env in ENVS:
        cfg = _load(tmp_path, text, env)
        out.append((cfg, plan_worker(0, cfg.workers[0], cfg.collector, _advertised(cfg))))
    return out


def test_the_section_has_the_files_and_the_node_environments() -> None:
    assert len(FILES) == 4 and len(ENVS) == 2
    assert [e["KVOBSERVE_COLLECTOR_NODE_RANK"] for e in ENVS] == ["0", "1"]


@pytest.mark.parametrize("text", FILES, ids=["sglang-url", "sglang-endpoints", "vllm-internal", "vllm-hybrid"])  # fmt: skip
def test_each_node_loads_the_same_file_and_watches_its_own_ranks(tmp_path: Path, text: str) -> None:
    plans = _plans(tmp_path, text)
    (c0, p0), (c1, p1) = plans
    assert c0.workers[0] == dataclasses.replace(c1.workers[0], leader=True)  # one [[worker]]
    assert (c0.collector.id, c1.collector.id) == ("node-0", "node-1")
    assert (c0.collector.host, c1.collector.host) == ("127.0.0.1", "127.0.0.1")  # beside engines
    assert (c0.workers[0].leader, c1.workers[0].leader) == (True, False)
    size = p0.dp_size
    assert size in (4, 8) and p1.dp_size == size
    for k, p in enumerate((p0, p1)):
        mine = list(range(k * size // 2, (k + 1) * size // 2))
        assert list(p.watched_ranks) == mine
        assert [s.endpoint for s in p.watched if not s.probe] == [
            f"tcp://127.0.0.1:{5557 + r}" for r in mine
        ]
        assert [s.replay_endpoint for s in p.watched if not s.probe] == [
            f"tcp://127.0.0.1:{5657 + r}" for r in mine
        ]
        sources = {(s.source, s.scope) for s in p.scheduler}
        if c0.workers[0].engine == "sglang":  # load PUBs of its own ranks, its own /metrics
            assert {e for s in p.scheduler if s.source == "load" for e in s.endpoints} == {
                f"tcp://127.0.0.1:{5565 + r}" for r in mine
            }
            assert ("metrics", "node") in sources
        elif "0.0.0.0" in str(c0.workers[0].metrics_url):
            assert sources == {("metrics", "node")}
        else:
            assert sources == ({("metrics", "leader")} if k == 0 else set())
        assert p.notes == (("probe tcp://127.0.0.1:5565 skipped: it is the SGLang load publisher's port",) if k == 1 and size == 8 else ())  # fmt: skip


def test_the_check_output_shown_is_what_node_1_prints(tmp_path: Path) -> None:
    shown = SECTION.split("$ kvobserve check -c /etc/kvobserve/kvobserve.toml\n", 1)[1]
    shown = shown.split("```", 1)[0]
    env = {**ENVS[1], "KVOBSERVE_COLLECTOR_HOST": NODE_HOSTS[1]}
    cfg = _load(tmp_path, FILES[0], env)
    as_collect = load_config(str(tmp_path / "kvobserve.toml"), {}, env, defaults=COLLECT_DEFAULTS)
    plan = plan_worker(0, cfg.workers[0], cfg.collector, _advertised(cfg))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _print_text(cfg, [plan_json(plan)], http_listens(cfg, as_collect))
    printed = out.getvalue().replace(
        str(tmp_path / "kvobserve.toml"), "/etc/kvobserve/kvobserve.toml"
    )
    assert printed.rstrip("\n") + "\n" == shown


def test_the_example_file_serves_both_nodes() -> None:
    """examples/kvobserve.toml: one file, each node its own ranks through the environment."""
    path = str(ROOT / "examples" / "kvobserve.toml")
    for k, env in enumerate(ENVS):
        cfg = load_config(path, {}, env)
        assert (cfg.collector.node_rank, cfg.collector.nnodes) == (k, 2)
        sglang, vllm = cfg.workers
        assert vllm.urls == ("http://10.0.0.5:8000", "http://10.0.0.6:8000")
        p = plan_worker(0, sglang, cfg.collector, None)
        assert [s.endpoint for s in p.watched if not s.probe] == [
            f"tcp://127.0.0.1:{5557 + r}" for r in range(4 * k, 4 * k + 4)
        ]
        assert {(s.source, s.scope) for s in p.scheduler} == {("metrics", "node"), ("load", "rank")}
