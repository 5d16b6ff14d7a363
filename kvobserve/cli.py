"""The `kvobserve` command: one subcommand per module, each with add_arguments() and run()."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from kvobserve import __version__

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
    "check": "validate a config and print what would be watched",
}


def module_name(command: str) -> str:
    """The module that implements `command`."""
    return f"kvobserve.commands.{command}"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser. Only `command`'s module is imported (all of them when None)."""
    parser = argparse.ArgumentParser(
        prog="kvobserve", description="Observe the KV caches of distributed LLM serving engines."
    )
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
