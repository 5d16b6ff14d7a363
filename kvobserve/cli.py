"""The `kvobserve` command: one subcommand per module, each with add_arguments() and run()."""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from kvobserve import __version__
from kvobserve.config.values import did_you_mean

# command -> one-line help; the command's module is kvobserve.commands.<command>, defining
#   add_arguments(parser: argparse.ArgumentParser) -> None
#   run(args: argparse.Namespace) -> int
COMMANDS: dict[str, str] = {
    "demo": "simulated fleet + collectors + aggregator in one process",
    "run": "collectors + aggregator + HTTP in one process, no NATS",
    "collect": "one node's collector, publishing snapshots to NATS",
    "aggregate": "the fleet aggregator: /metrics, API, status page",
    "simulate": "simulated engine workers with faults and ground truth",
    "tap": "decode a live or recorded KV-event stream, one JSON line per batch",
    "status": "the aggregator's view as a terminal table",
    "overlap": "where would a request hit: the leading blocks each rank holds now",
    "check": "validate a config and print what would be watched",
}


def module_name(command: str) -> str:
    """The module that implements `command`."""
    return f"kvobserve.commands.{command}"


class Parser(argparse.ArgumentParser):
    """argparse without abbreviations (`--profil gap` is an error, never `--profile gap`), with
    "did you mean" for an unknown flag, command or choice (3.11 suggests none of them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})  # sub-parsers too

    def error(self, message: str) -> NoReturn:
        """Print usage and `message` with a suggestion, exit 2."""
        super().error(message + _suggestion(self, message))

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """As argparse, but a flag the chosen command does not know is that command's error,
        with its usage (argparse reports it as the top level's, with the list of commands)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            _chosen(self, parsed).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        """A value of a `choices=` argument (a command, a flag's value), or the closest one."""
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as exc:
            hint = did_you_mean(value, [str(c) for c in action.choices or ()])
            raise argparse.ArgumentError(action, exc.message + hint) from None


def _chosen(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> Parser:
    """The sub-parser of the command `parsed` holds, else `parser` itself."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices.get(str(getattr(parsed, action.dest, "")))
            if isinstance(sub, Parser):
                return sub
    assert isinstance(parser, Parser)
    return parser


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [o for a in parser._actions for o in a.option_strings if o.startswith("--")]


def _suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """'; did you mean --timeout?' for the first unknown flag that is close to a known one."""
    if not message.startswith("unrecognized arguments:"):
        return ""
    known = _options(parser)
    for action in parser._actions:  # the top-level parser: the chosen command's flags
        if isinstance(action, argparse._SubParsersAction):
            chosen = getattr(parser, "chosen", None)
            if chosen in action.choices:
                known += _options(action.choices[chosen])
    for word in message.split(":", 1)[1].split():
        if re.match(r"-[0-9]", word):  # argparse takes only a plain negative number as a value
            return (
                f"; {word!r} looks like values starting with a negative number: separate them "
                "with spaces, or put `--` before them"
            )
        if word.startswith("-"):
            flag = word.split("=", 1)[0]
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            if close:
                return f"; did you mean {close[0]}?"
    return ""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser. Only `command`'s module is imported (all of them when None)."""
    parser = Parser(
        prog="kvobserve", description="Observe the KV caches of distributed LLM serving engines."
    )
    parser.chosen = command  # type: ignore[attr-defined]  # read by _suggestion
    parser.add_argument("--version", action="version", version=f"kvobserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if command is not None and name != command:
            continue  # listed in --help, but its (possibly heavy) module is not imported
        mod = importlib.import_module(module_name(name))
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    try:
        return int(args._run(args))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvobserve check ... | head`: the reader left, which is no error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
