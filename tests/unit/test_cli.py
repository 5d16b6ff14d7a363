"""The `kvobserve` dispatcher: every command resolves, and only the chosen module is imported."""

from __future__ import annotations

import argparse
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
        (["check", "--prob"], "did you mean --probe?"),  # no abbreviations
        (["check", "--no-discovry"], "did you mean --no-discovery?"),
        (["stauts"], "did you mean 'status'?"),
        # issue 21: a prefix of a flag is not that flag, and a near-miss value gets its choice
        (["simulate", "--profil", "gap"], "did you mean --profile?"),
        (["simulate", "--profile", "gapp"], "did you mean 'gap'?"),
        (["simulate", "--format", "vllm-0.3"], "did you mean 'vllm-0.33'?"),
        (["simulate", "--dp-lb", "hybird"], "did you mean 'hybrid'?"),
        (["simulate", "--event-plane", "nat"], "did you mean 'nats'?"),
        (["simulate", "--indexer-mode", "lose-removals"], "did you mean 'lose_removals'?"),
        (["run", "--engine", "vlm", "--kv-endpoint", "tcp://127.0.0.1:1"], "did you mean 'vllm'?"),
        (["run", "--engine", "dynamo", "--event-plane", "zqm"], "did you mean 'zmq'?"),
        (["run", "--engine", "dynamo", "--event-plane", "zmq", "--zmq-endpoints",
          "tcp://127.0.0.1:1", "--keep-ranks", "al"], "did you mean 'all'?"),
        (["run", "--engine", "dynamo", "--event-plane", "zmq", "--zmq-endpoints",
          "tcp://127.0.0.1:1", "--indexer-api", "dumb"], "did you mean 'dump'?"),
    ],
)  # fmt: skip
def test_unknown_flags_and_commands_get_a_suggestion(argv: list[str], hint: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvobserve", *argv], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2 and proc.stdout == ""
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("kvobserve") and ": error: " in last
    assert last.endswith(hint), last


@pytest.mark.parametrize(
    ("argv", "last"),
    [
        (["collect", "--node-rnak", "1"],
         "kvobserve collect: error: unrecognized arguments: --node-rnak 1; did you mean "
         "--node-rank?"),
        (["check", "-c", "x.toml", "--prob"],
         "kvobserve check: error: unrecognized arguments: --prob; did you mean --probe?"),
        (["overlap", "--url", "x", "--poll", "w"],
         "kvobserve overlap: error: unrecognized arguments: --poll; did you mean --pool?"),
    ],
)  # fmt: skip
def test_an_unknown_flag_shows_the_commands_usage(argv: list[str], last: str) -> None:
    """Issue 30: `collect --node-rnak 1` printed the top-level usage (`kvobserve [-h]
    [--version] COMMAND ...`), as if the command were the mistake."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvobserve", *argv], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert lines[0].startswith(f"usage: kvobserve {argv[0]} [-h]"), lines[0]
    assert "COMMAND" not in proc.stderr
    assert lines[-1] == last


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    out = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += _parsers(sub)
    return out


def test_no_parser_takes_an_abbreviated_flag() -> None:
    """`--profil gap` was silently `--profile gap` (argparse's allow_abbrev, on by default)."""
    parsers = _parsers(build_parser())
    assert len(parsers) == 1 + len(COMMANDS)
    assert [p.prog for p in parsers if p.allow_abbrev] == []
    with pytest.raises(SystemExit):
        build_parser("simulate").parse_args(["simulate", "--profil", "gap"])
    args = build_parser("simulate").parse_args(["simulate", "--profile", "gap"])
    assert args.profile == "gap"


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
