"""The `kvobserve` dispatcher: every command resolves, and only the chosen module is imported."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvobserve.cli import COMMANDS, build_parser, main, module_name


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_module_has_add_arguments_and_run(name: str) -> None:
    mod = importlib.import_module(module_name(name))
    assert callable(mod.add_arguments) and callable(mod.run)
    sub = build_parser(name)._subparsers._group_actions[0].choices[name]  # type: ignore[union-attr]
    assert sub.get_default("_run") is mod.run


def test_tap_does_not_import_the_aggregator_or_nats() -> None:
    code = (
        "import sys; from kvobserve.cli import build_parser; build_parser('tap');"
        "print(sorted(m for m in sys.modules if m in ('nats', 'kvobserve.aggregator', 'aiohttp')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_help_lists_every_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvobserve", "--help"], capture_output=True, text=True, check=True
    )
    for name in COMMANDS:
        assert name in out.stdout


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["tap", "--tiemout", "3", "tcp://127.0.0.1:1"], "did you mean --timeout?"),
        (["status", "--urll", "x"], "did you mean --url?"),
        (["check", "--prob"], ""),  # an ambiguous abbreviation: argparse names the candidates
        (["check", "--no-discovry"], "did you mean --no-discovery?"),
        (["stauts"], "did you mean 'status'?"),
    ],
)
def test_unknown_flags_and_commands_get_a_suggestion(argv: list[str], hint: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvobserve", *argv], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2 and proc.stdout == ""
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("kvobserve") and ": error: " in last
    if hint:
        assert last.endswith(hint), last
    else:
        assert "could match --probe-extra-ports, --probe, --probe-seconds" in last


@pytest.mark.parametrize(
    ("extra", "line", "listens"),
    [
        # a node of a NATS fleet runs `collect` (its own view on 9478) or `aggregate` (9477)
        ('[nats]\nurl = "nats://127.0.0.1:4222"\n',
         "http 127.0.0.1:9478 (collect; aggregate 127.0.0.1:9477)  nats nats://127.0.0.1:4222",
         {"collect": "127.0.0.1:9478", "aggregate": "127.0.0.1:9477"}),
        ('[nats]\nurl = "nats://127.0.0.1:4222"\n[http]\nlisten = "127.0.0.2:9000"\n',
         "http 127.0.0.2:9000 (collect; aggregate 127.0.0.2:9000)  nats nats://127.0.0.1:4222",
         {"collect": "127.0.0.2:9000", "aggregate": "127.0.0.2:9000"}),
        ("", "http 127.0.0.1:9477 (run)  nats embedded", {"run": "127.0.0.1:9477"}),
    ],
)  # fmt: skip
def test_check_prints_where_each_command_serves_http(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: str,
    line: str,
    listens: dict[str, str],
) -> None:
    """Issue 21: `check` printed 127.0.0.1:9477 for a node that runs `collect` (9478)."""
    cfg = tmp_path / "kvobserve.toml"
    cfg.write_text(
        '[[worker]]\nid = "w"\nengine = "sglang"\nkv_endpoint = "tcp://*:5557"\ndp_size = 1\n'
        + extra
    )
    assert main(["check", "-c", str(cfg), "--no-discovery"]) == 0
    assert line in capsys.readouterr().out.splitlines()
    assert main(["check", "-c", str(cfg), "--no-discovery", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["http"] == listens
