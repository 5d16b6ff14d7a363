"""`kvobserve overlap --url URL [HASH ...]`: where would this request hit, rank by rank.

Asks the aggregator's /api/v1/overlap how many leading blocks of a request each rank of the pool
holds now, and prints it as a table (or the API's JSON with --json). The hashes are the engine's
block hashes of the request in order, as `kvobserve tap` prints them: as arguments, or on stdin
(one or more per line), or tap's JSON lines: each batch's BlockStored events split into requests
by their parent chains (commands/tap_requests.py), or `tap --requests` lines, one request each.
Each request is asked and printed in turn (a batch of a busy rank holds several).

Exit 0 when every rank's collector answered, 1 when some did not (their ranks have no count),
2 on bad input or when the aggregator cannot be asked.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import urllib.parse
from dataclasses import dataclass
from typing import Any, TextIO

from kvobserve.commands.status import DEFAULT_URL, PASSWORD_ENV, FetchError, base_url, fetch
from kvobserve.commands.tap_requests import Requests
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


MAX_REQUESTS = 100  # questions one run asks (tap's lines of a busy rank hold a few dozen)


@dataclass(frozen=True, slots=True)
class Question:
    """One request to ask about: its hashes as text, where in the input it was (when the input
    held several), the block it hangs off when tap saw that stored before (its hashes start
    after it), and how many blocks it had when more than the API takes were given."""

    hashes: list[str]
    where: str = ""
    parent: str | None = None
    total: int = 0

    def title(self, k: int, n: int) -> str:
        """A line saying which request this is and what its count covers; "" for the only
        request of plain input."""
        notes = [self.where] if self.where and n > 1 else []
        if self.parent is not None:
            notes.append(f"after block {self.parent}, stored before the input")
        if self.total > len(self.hashes):
            notes.append(f"its first {len(self.hashes)} of {self.total} blocks (the limit)")
        head = f"request {k} of {n}" if n > 1 else "request"
        return f"{head}: {'; '.join(notes)}" if notes else ""


def _hash_texts(items: list[Any], where: str) -> list[str]:
    """JSON values of hashes as text (an integer, or hex)."""
    out = []
    for h in items:
        if isinstance(h, bool) or not isinstance(h, int | str):
            raise InputError(f"{where}: {json.dumps(h)} is not a block hash")
        out.append(str(h))
    return out


def _valid_stores(events: Any, where: str) -> list[Any]:
    """A tap line's events, each BlockStored checked to hold hashes (as the splitter needs)."""
    if not isinstance(events, list):
        raise InputError(f"{where}: `events` is not a list (not a `kvobserve tap` line)")
    for ev in events:
        if isinstance(ev, dict) and ev.get("type") == "BlockStored":
            hashes, parent = ev.get("block_hashes") or [], ev.get("parent_block_hash")
            if not isinstance(hashes, list):
                raise InputError(f"{where}: block_hashes {json.dumps(hashes)} is not a list")
            _hash_texts([*hashes, *([] if parent is None else [parent])], where)
    return events


def _tap_questions(doc: dict[str, Any], where: str, requests: Requests) -> list[Question]:
    """A tap line: a batch (its requests, split by parent chains) or one `--requests` line."""
    seq = f"seq {doc.get('seq')}"
    if "events" in doc:
        return [
            Question(
                _hash_texts(r.hashes, where),
                f"{seq} request {r.index} ({where})",
                None if r.parent is None else str(r.parent),
            )
            for r in requests.split(_valid_stores(doc["events"], where))
        ]
    hashes, parent = doc.get("block_hashes"), doc.get("parent_block_hash")
    if not isinstance(hashes, list):
        raise InputError(
            f"{where}: a JSON object without `events` or `block_hashes` (not a `kvobserve tap` "
            "line)"
        )
    at = f"{seq} request {doc.get('request')} ({where})"
    above = None if parent is None else _hash_texts([parent], where)[0]
    return [Question(_hash_texts(hashes, where), at, above)]


def read_requests(args: list[str], stdin: TextIO | None) -> list[Question]:
    """The requests to ask about, in order: the arguments (one request), else stdin: plain
    hashes or JSON lists (one request), or `kvobserve tap` lines (each batch's requests, split
    by parent chains, or tap --requests' lines, one request each)."""
    if args:
        return [Question([x for a in args for x in _SPLIT.split(a.strip()) if x])]
    if stdin is None:
        raise InputError(
            "no hashes: give them as arguments or on stdin (e.g. piped from `kvobserve tap`)"
        )
    plain: list[str] = []
    questions: list[Question] = []
    requests = Requests()
    tap = False
    for n, raw in enumerate(stdin, 1):
        line = raw.strip()
        where = f"stdin line {n}"
        if not line:
            continue
        if line[0] not in "{[":
            plain += [x for x in _SPLIT.split(line) if x]
            continue
        try:
            doc = json.loads(line)
        except ValueError as exc:
            raise InputError(f"{where}: not JSON: {exc}") from None
        if isinstance(doc, dict):
            tap = True
            questions += _tap_questions(doc, where, requests)
        else:
            plain += _hash_texts(doc, where)
    if tap and plain:
        raise InputError(
            "stdin holds `kvobserve tap` lines and plain hashes: give one or the other"
        )
    if plain:
        return [Question(plain)]
    if not questions:
        what = "no BlockStored event with block hashes" if tap else "no hashes"
        raise InputError(f"{what} on stdin")
    if len(questions) > MAX_REQUESTS:
        raise InputError(
            f"{len(questions)} requests on stdin: at most {MAX_REQUESTS} a run (fewer batches, "
            "e.g. `kvobserve tap ... --requests --count N`)"
        )
    return questions


def _check(q: Question, whole: bool) -> Question:
    """The hashes in the API's text form; InputError names a bad one. More than the API takes:
    an error when `whole` (hashes given by hand), else the first ones, with the count kept."""
    texts = q.hashes
    if len(texts) > MAX_HASHES and whole:
        raise InputError(f"{len(texts)} hashes: at most {MAX_HASHES} per request")
    out = []
    for i, t in enumerate(texts[:MAX_HASHES], 1):
        try:
            h = parse_hash(t)
        except HashError as exc:
            where = f"{q.where}: " if q.where else ""
            raise InputError(f"{where}hash {i} of {len(texts)}: {exc}") from None
        out.append(h.hex() if isinstance(h, bytes) else str(h))
    return dataclasses.replace(q, hashes=out, total=len(texts))


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


def _ask(args: argparse.Namespace, hashes: list[str]) -> dict[str, Any]:
    """The aggregator's answer for one request; FetchError when it cannot be had."""
    query: dict[str, str] = {"hashes": ",".join(hashes)}
    if args.pool:
        query["pool"] = args.pool
    if args.wait is not None:
        query["timeout_s"] = f"{args.wait:g}"
    base = base_url(str(args.url))
    url = f"{base}/api/v1/overlap?{urllib.parse.urlencode(query, safe=',')}"
    doc = fetch(url, args.timeout, args.user, args.cacert)
    if not isinstance(doc, dict) or not isinstance(doc.get("ranks"), list):
        raise FetchError(f"{base} did not answer like a kvobserve aggregator")
    return doc


def run(args: argparse.Namespace, out: TextIO | None = None, stdin: TextIO | None = None) -> int:
    """Ask and print, request by request; 1 when a collector did not answer, 2 on bad input or
    no aggregator."""
    out = out or sys.stdout
    if stdin is None and not args.hashes and not sys.stdin.isatty():
        stdin = sys.stdin
    try:
        questions = [_check(q, whole=not q.where) for q in read_requests(args.hashes, stdin)]
    except InputError as exc:
        print(f"kvobserve overlap: error: {exc}", file=sys.stderr)
        return 2
    missing = False
    for k, q in enumerate(questions, 1):
        try:
            doc = _ask(args, q.hashes)
        except FetchError as exc:
            print(f"kvobserve overlap: {exc}", file=sys.stderr)
            return 2
        missing = missing or bool(doc.get("missing"))
        if args.json:
            out.write(json.dumps(doc, indent=2) + "\n")
            continue
        title = q.title(k, len(questions))
        out.write(("\n" if k > 1 else "") + (f"{title}\n" if title else "") + render(doc))
        out.flush()
    return 1 if missing else 0
