"""`kvobserve status --url URL`: the aggregator's streams and active conditions as a terminal table."""

from __future__ import annotations

import argparse
import base64
import json
import os
import ssl
import sys
import urllib.error
import urllib.request
from typing import Any, TextIO

DEFAULT_URL = "http://127.0.0.1:9477"
PASSWORD_ENV = "KVOBSERVE_STATUS_PASSWORD"


class FetchError(Exception):
    """The aggregator could not be reached or answered badly; the message names the URL."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvobserve status`."""
    parser.add_argument("--url", default=DEFAULT_URL, help=f"aggregator base URL ({DEFAULT_URL})")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per request (5)")
    parser.add_argument(
        "--user", default="", help=f"basic-auth user; the password is read from ${PASSWORD_ENV}"
    )
    parser.add_argument("--cacert", default="", help="CA bundle to verify an https aggregator")
    parser.add_argument("--json", action="store_true", help="print the raw JSON instead")


def fetch(url: str, timeout: float, user: str = "", cacert: str = "") -> Any:
    """GET a JSON document; FetchError names the URL on any failure."""
    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    if user:
        token = base64.b64encode(f"{user}:{os.environ.get(PASSWORD_ENV, '')}".encode()).decode()
        req.add_header("Authorization", f"Basic {token}")
    ctx = ssl.create_default_context(cafile=cacert) if cacert else None
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as resp:
            return json.loads(resp.read(16 * 1024 * 1024))
    except urllib.error.HTTPError as exc:
        hint = " (pass --user and set $" + PASSWORD_ENV + ")" if exc.code == 401 else ""
        raise FetchError(f"{url}: HTTP {exc.code} {exc.reason}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise FetchError(f"cannot reach {url}: {reason}") from None
    except ValueError as exc:
        raise FetchError(f"{url}: not JSON: {exc}") from None


def _usage(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def render(streams: list[dict[str, Any]], alerts: list[dict[str, Any]]) -> str:
    """The terminal table and the conditions below it."""
    head = ("WORKER", "RANK", "NODE", "OWNER", "UP", "BATCHES", "GAPS", "LOST", "USAGE")
    rows = [
        (
            str(s["worker_id"]),
            str(s["dp_rank"]),
            str(s["node_rank"]),
            str(s["collector"]),
            "up" if s["up"] else ("down" if s["live"] else "stale"),
            str(s["batches"]),
            str(s["gaps"]),
            str(s["lost"]),
            _usage(s.get("usage_ratio")),
        )
        for s in streams
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    numeric = {1, 2, 5, 6, 7, 8}

    def line(cells: tuple[str, ...]) -> str:
        parts = [
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    out = [line(head), *(line(r) for r in rows)]
    if not rows:
        out.append("(no streams)")
    up = sum(1 for s in streams if s["up"])
    out.append("")
    out.append(f"{up}/{len(streams)} streams up, {len(alerts)} active conditions")
    for a in alerts:
        labels = " ".join(f"{k}={v}" for k, v in a["labels"].items())
        out.append(f"  {a['severity'].upper():8} {a['kind']:26} {labels}: {a['description']}")
    return "\n".join(out) + "\n"


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Fetch /api/v1/streams and /api/v1/alerts and print them; 2 when unreachable."""
    out = out or sys.stdout
    base = str(args.url).rstrip("/")
    try:
        streams = fetch(f"{base}/api/v1/streams", args.timeout, args.user, args.cacert)
        alerts = fetch(f"{base}/api/v1/alerts", args.timeout, args.user, args.cacert)
    except FetchError as exc:
        print(f"kvobserve status: {exc}", file=sys.stderr)
        return 2
    if not isinstance(streams, list) or not isinstance(alerts, list):
        print(
            f"kvobserve status: {base} did not answer like a kvobserve aggregator", file=sys.stderr
        )
        return 2
    if args.json:
        out.write(json.dumps({"streams": streams, "alerts": alerts}, indent=2) + "\n")
    else:
        out.write(render(streams, alerts))
    return 0
