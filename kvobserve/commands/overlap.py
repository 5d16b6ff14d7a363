"""`kvobserve overlap --url URL [HASH ...]`: where would this request hit, rank by rank.

Asks the aggregator's /api/v1/overlap how many leading blocks of a request each rank of the pool
holds now, and prints it as a table (or the API's JSON with --json). The hashes are the engine's
block hashes of the request in order, as `kvobserve tap` prints them: as arguments, or on stdin
(one or more per line, or tap's JSON lines: the block hashes of their BlockStored events, which
must chain into one request).

Exit 0 when every rank's collector answered, 1 when some did not (their ranks have no count),
2 on bad input or when the aggregator cannot be asked.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.parse
from typing import Any, TextIO

from kvobserve.commands.status import DEFAULT_URL, PASSWORD_ENV, FetchError, base_url, fetch
from kvobserve.wire.overlap import MAX_HASHES, HashError, parse_hash

_SPLIT = re.compile(r"[\s,]+")


class InputError(ValueError):
    """Hashes that cannot be read; the message names the value and where it was."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvobserve overlap`."""
    parser.add_argument(
        "hashes",
        nargs="*",
        metavar="HASH",
        help="the request's block hashes in order (default: read from stdin, e.g. piped from "
        "`kvobserve tap`)",
    )
    parser.add_argument(
        "--url", default=DEFAULT_URL, help=f"aggregator base URL or host:port ({DEFAULT_URL})"
    )
    parser.add_argument(
        "--pool", default=None, help="the pool: a worker id (default: every rank of the fleet)"
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=None,
        metavar="S",
        help="seconds the aggregator waits for the collectors' answers (its default: 1)",
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per request (10)")
    parser.add_argument(
        "--user", default="", help=f"basic-auth user; the password is read from ${PASSWORD_ENV}"
    )
    parser.add_argument("--cacert", default="", help="CA bundle to verify an https aggregator")
    parser.add_argument("--json", action="store_true", help="print the API's JSON instead")


def _hash_texts(items: list[Any], where: str) -> list[str]:
    """JSON values of hashes as text (an integer, or hex)."""
    out = []
    for h in items:
        if isinstance(h, bool) or not isinstance(h, int | str):
            raise InputError(f"{where}: {json.dumps(h)} is not a block hash")
        out.append(str(h))
    return out


def _add_tap_line(out: list[str], doc: dict[str, Any], where: str) -> None:
    """Append the block hashes of a tap line's BlockStored events; each must hang off the hash
    before it (the first one of the input may hang off blocks cached before it was stored)."""
    events = doc.get("events")
    if not isinstance(events, list):
        raise InputError(f"{where}: a JSON object without `events` (not a `kvobserve tap` line)")
    for ev in events:
        if not isinstance(ev, dict) or ev.get("type") != "BlockStored":
            continue
        hashes = _hash_texts(ev.get("block_hashes") or [], where)
        parent = ev.get("parent_block_hash")
        if out and hashes and (parent is None or str(parent) != out[-1]):
            raise InputError(
                f"{where}: a BlockStored event whose parent_block_hash {json.dumps(parent)} is "
                f"not the hash before it ({out[-1]}): the input holds more than one request; "
                "give one (e.g. `kvobserve tap ... --count 1`, or its hashes as arguments)"
            )
        out += hashes


def read_hashes(args: list[str], stdin: TextIO | None) -> list[str]:
    """The hashes as text, in order: from the arguments, else from `stdin`."""
    if args:
        return [x for a in args for x in _SPLIT.split(a.strip()) if x]
    if stdin is None:
        raise InputError(
            "no hashes: give them as arguments or on stdin (e.g. piped from `kvobserve tap`)"
        )
    out: list[str] = []
    tap = False
    for n, raw in enumerate(stdin, 1):
        line = raw.strip()
        where = f"stdin line {n}"
        if not line:
            continue
        if line[0] not in "{[":
            out += [x for x in _SPLIT.split(line) if x]
            continue
        try:
            doc = json.loads(line)
        except ValueError as exc:
            raise InputError(f"{where}: not JSON: {exc}") from None
        if isinstance(doc, dict):
            tap = True
            _add_tap_line(out, doc, where)
        else:
            out += _hash_texts(doc, where)
    if not out:
        what = "no BlockStored event with block hashes" if tap else "no hashes"
        raise InputError(f"{what} on stdin")
    return out


def _check(texts: list[str]) -> list[str]:
    """The hashes in the API's text form; InputError names a bad one and the limit."""
    if len(texts) > MAX_HASHES:
        raise InputError(f"{len(texts)} hashes: at most {MAX_HASHES} per request")
    out = []
    for i, t in enumerate(texts, 1):
        try:
            h = parse_hash(t)
        except HashError as exc:
            raise InputError(f"hash {i} of {len(texts)}: {exc}") from None
        out.append(h.hex() if isinstance(h, bytes) else str(h))
    return out


def render(doc: dict[str, Any]) -> str:
    """The answer as a terminal table, then which ranks hold the most and who did not answer."""
    head = ("WORKER", "NODE", "RANK", "LEADING", "TRUST", "COLLECTOR", "REASON")
    rows = [
        (
            str(r["worker_id"]),
            "-" if r["node_rank"] is None else str(r["node_rank"]),
            str(r["dp_rank"]),
            "-" if r["leading_blocks"] is None else str(r["leading_blocks"]),
            r["trust"] or "-",
            r["collector"] or "-",
            r["reason"] or "",
        )
        for r in doc["ranks"]
    ]
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head) - 1)]

    def line(cells: tuple[str, ...]) -> str:
        parts = [
            c.rjust(w) if i in (1, 2, 3) else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=False))
        ]
        return ("  ".join(parts) + "  " + cells[-1]).rstrip()

    n = doc["hashes"]
    pool = f"pool {doc['pool']}" if doc["pool"] else "every worker"
    out = [f"{n} hashes asked of {pool} ({', '.join(doc['workers']) or 'no workers yet'})", ""]
    out += [line(head), *(line(r) for r in rows)]
    if not rows:
        out.append("(no ranks)")
    known = [r for r in doc["ranks"] if r["leading_blocks"] is not None]
    out.append("")
    if known:
        best = max(r["leading_blocks"] for r in known)
        where = [
            f"{r['worker_id']} rank {r['dp_rank']}" for r in known if r["leading_blocks"] == best
        ]
        shown = ", ".join(where[:8]) + (f" and {len(where) - 8} more" if len(where) > 8 else "")
        if best:
            out.append(f"most: {best} of {n} blocks, on {shown}")
        else:
            out.append("no rank holds the first block: the request would hit nowhere")
    if doc["missing"]:
        out.append(
            f"missing: {', '.join(doc['missing'])} did not answer (their ranks have no count)"
        )
    return "\n".join(out) + "\n"


def run(args: argparse.Namespace, out: TextIO | None = None, stdin: TextIO | None = None) -> int:
    """Ask and print; 1 when a collector did not answer, 2 on bad input or no aggregator."""
    out = out or sys.stdout
    if stdin is None and not args.hashes and not sys.stdin.isatty():
        stdin = sys.stdin
    try:
        hashes = _check(read_hashes(args.hashes, stdin))
    except InputError as exc:
        print(f"kvobserve overlap: error: {exc}", file=sys.stderr)
        return 2
    query: dict[str, str] = {"hashes": ",".join(hashes)}
    if args.pool:
        query["pool"] = args.pool
    if args.wait is not None:
        query["timeout_s"] = f"{args.wait:g}"
    base = base_url(str(args.url))
    url = f"{base}/api/v1/overlap?{urllib.parse.urlencode(query, safe=',')}"
    try:
        doc = fetch(url, args.timeout, args.user, args.cacert)
    except FetchError as exc:
        print(f"kvobserve overlap: {exc}", file=sys.stderr)
        return 2
    if not isinstance(doc, dict) or not isinstance(doc.get("ranks"), list):
        print(
            f"kvobserve overlap: {base} did not answer like a kvobserve aggregator", file=sys.stderr
        )
        return 2
    out.write(json.dumps(doc, indent=2) + "\n" if args.json else render(doc))
    return 1 if doc.get("missing") else 0
