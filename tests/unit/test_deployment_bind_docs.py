"""docs/deployment.md, the bind-mode sections: each file loads, plans what the text says, and the
`kvobserve check` lines shown are what check prints for it."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from kvobserve.commands.check import _print_text, http_listens, plan_json
from kvobserve.config import load_config
from kvobserve.config.bind import TopicTemplate
from kvobserve.sources.plan import WorkerPlan, plan_worker

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "deployment.md").read_text()
HEADINGS = ("## Engines that connect: kvobserve binds", "## llm-d: central mode with a relay")


def _section(heading: str) -> str:
    return PAGE.split(heading, 1)[1].split("\n## ", 1)[0]


def _plan(tmp_path: Path, heading: str) -> WorkerPlan:
    (text,) = re.findall(r"```toml\n(.*?)```", _section(heading), re.S)
    path = tmp_path / "kvobserve.toml"
    path.write_text(text)
    cfg = load_config(str(path), {}, {})
    return plan_worker(0, cfg.workers[0], cfg.collector, None)


def _engine_flags(heading: str) -> dict[str, object]:
    m = re.search(r"--kv-events-config \\\n  '(\{.*?\})'", _section(heading))
    assert m is not None
    flags: dict[str, object] = json.loads(m.group(1))
    return flags


@pytest.mark.parametrize("heading", HEADINGS)
def test_the_check_lines_shown_are_what_check_prints(tmp_path: Path, heading: str) -> None:
    plan = _plan(tmp_path, heading)
    path = tmp_path / "kvobserve.toml"
    out = io.StringIO()
    cfg = load_config(str(path), {}, {})
    with contextlib.redirect_stdout(out):
        _print_text(cfg, [plan_json(plan)], http_listens(cfg, None))
    printed = out.getvalue().splitlines()
    shown = _section(heading).split("$ kvobserve check -c ", 1)[1].split("```", 1)[0]
    lines = [ln for ln in shown.splitlines()[1:] if ln != "..."]
    assert lines, heading
    start = printed.index(lines[0])
    assert printed[start : start + len(lines)] == lines


def test_vllm_flags_and_the_bind_file_agree(tmp_path: Path) -> None:
    flags = _engine_flags(HEADINGS[0])
    plan = _plan(tmp_path, HEADINGS[0])
    assert flags["endpoint"] == "tcp://10.0.0.9:5557"  # a host: vLLM connects
    assert [x.endpoint for x in plan.listens] == ["tcp://*:5557", "tcp://*:5558"]
    assert [x.replay_endpoint for x in plan.listens] == [
        "tcp://10.0.0.5:5558", "tcp://10.0.0.5:5559"
    ]  # fmt: skip
    assert flags["replay_endpoint"] == "tcp://*:5558"  # bound on the engine's node (10.0.0.5)
    assert [s.topic for s in plan.streams] == [flags["topic"]] * 2


def test_llm_d_flags_and_the_relay_file_agree(tmp_path: Path) -> None:
    flags = _engine_flags(HEADINGS[1])
    plan = _plan(tmp_path, HEADINGS[1])
    x, y = plan.listens  # two DP ranks: 5556 + rank
    assert plan.pods and (x.endpoint, y.endpoint) == ("tcp://*:5556", "tcp://*:5557")
    assert "--data-parallel-size=2" in _section(HEADINGS[1])
    assert str(flags["endpoint"]).endswith(":5556")
    topic = str(flags["topic"]).replace("$(POD_IP)", "10.4.2.17").replace("$(POD_PORT)", "8000")
    assert TopicTemplate.parse(x.topic, "topic").match(topic) == {
        "pod": "10.4.2.17:8000", "model": "Qwen/Qwen3-32B"
    }  # fmt: skip
    assert (
        x.replay_endpoint
        == "tcp://{pod_ip}:5559"
        == str(flags["replay_endpoint"]).replace("*", "{pod_ip}")
    )
    assert (x.relay_to, y.relay_to) == ("tcp://llm-d-epp:5556", "tcp://llm-d-epp:5557")
