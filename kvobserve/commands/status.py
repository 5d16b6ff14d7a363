"""`kvobserve status --url URL`: the aggregator's streams and active conditions as a terminal table.

The conditions are listed by cause, what follows from a cause indented under it (as
/api/v1/alerts nests them). Exit 0 when no critical cause is active, 1 when one is (a lost
collector is one cause, whatever its streams and ranks), 2 when the aggregator cannot be read.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
from typing import Any, TextIO

from kvobserve.export.status_page import conditions_line

DEFAULT_URL = "http://127.0.0.1:9477"
PASSWORD_ENV = "KVOBSERVE_STATUS_PASSWORD"


class FetchError(Exception):
    """The aggregator could not be reached or answered badly; the message names the URL."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvobserve status`."""
    parser.add_argument(
        "--url", default=DEFAULT_URL, help=f"aggregator base URL or host:port ({DEFAULT_URL})"
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per request (5)")
    parser.add_argument(
        "--user", default="", help=f"basic-auth user; the password is read from ${PASSWORD_ENV}"
    )
    parser.add_argument("--cacert", default="", help="CA bundle to verify an https aggregator")
    parser.add_argument("--json", action="store_true", help="print the raw JSON instead")
    parser.add_argument(
        "--events", action="store_true", help="also print the recent events (newest first)"
    )


def fetch(url: str, timeout: float, user: str = "", cacert: str = "") -> Any:
    """GET a JSON document; FetchError names the URL (without its query) on any failure, with
    the body of an error answer (the API says there what was wrong with the request)."""
    shown = url.split("?", 1)[0]
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
        body = exc.read(2000).decode("utf-8", "replace").strip().split("\n", 1)[0]
        said = f": {body}" if body and exc.code != 401 else ""
        raise FetchError(f"{shown}: HTTP {exc.code} {exc.reason}{hint}{said}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise FetchError(f"cannot reach {shown}: {reason}") from None
    except ValueError as exc:
        raise FetchError(f"{shown}: not JSON: {exc}") from None


def base_url(url: str) -> str:
    """`host:port` -> `http://host:port`; a URL with a scheme stays as it is (no trailing /)."""
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _secs(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{1000 * v:.0f}ms" if v < 1 else f"{v:.1f}s"


def _hms(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(t)) if t else "-"


# USAGE: cache usage (kvobserve_kv_cache_usage_ratio); TOKEN_USAGE: the scheduler's token usage
# (kvobserve_scheduler_token_usage_ratio). Both "-" while unknown (a down stream: docs/metrics.md).
_HEAD = (
    "WORKER", "RANK", "NODE", "COLLECTOR", "STATE", "BATCHES", "GAPS", "LOST", "RESTARTS",
    "DUP", "LAG", "AGE", "USAGE", "TOKEN_USAGE", "REASON",
)  # fmt: skip
_NUMERIC = {1, 2, 5, 6, 7, 8, 10, 11, 12, 13}


def _row(s: dict[str, Any]) -> tuple[str, ...]:
    state = s.get("state") or ("up" if s["up"] else "down" if s["live"] else "stale")
    dup = s.get("duplicate_stream")
    return (
        str(s["worker_id"]),
        str(s["dp_rank"]),
        str(s["node_rank"]),
        str(s["collector"]),
        state,
        str(s["batches"]),
        str(s["gaps"]),
        str(s["lost"]),
        str(s["restarts"]),
        "-" if dup is None else "yes" if dup else "no",
        _secs(s.get("lag_seconds")),
        _secs(s.get("last_message_age_s")),
        _pct(s.get("cache_usage_ratio")) if not s.get("unvouched") else "?",
        _pct(s.get("token_usage_ratio")),
        str(s.get("reason") or "") + _unvouched(s),
    )


def _unvouched(s: dict[str, Any]) -> str:
    """Why cache usage is "?": the index cannot vouch for it (what is certainly resident)."""
    un = s.get("unvouched")
    if not un:
        return ""
    lower = un["lower_bound"]["tokens"]
    return f"; cache not seen whole ({un['reason']}): >= {lower:,} tokens resident"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in [_HEAD, *rows]) for i in range(len(_HEAD) - 1)]

    def line(cells: tuple[str, ...]) -> str:
        parts = [
            c.rjust(w) if i in _NUMERIC else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=False))
        ]
        return ("  ".join(parts) + "  " + cells[-1]).rstrip()

    return [line(_HEAD), *(line(r) for r in rows)]


def render(
    streams: list[dict[str, Any]],
    alerts: list[dict[str, Any]],
    fleet: dict[str, Any] | None = None,
    events: list[dict[str, Any]] | None = None,
) -> str:
    """The terminal table, the collectors, stray publishers, conditions and (opt.) events."""
    out = _table([_row(s) for s in streams])
    if not streams:
        out.append("(no streams)")
    fleet = fleet or {}
    cols = fleet.get("collectors", [])
    if cols:
        out.append("")
        out.append(
            "collectors: "
            + ", ".join(
                f"{c['collector']} {'up' if c['up'] else 'DOWN'} ({c['age_s']:.1f}s)" for c in cols
            )
        )
    for w in fleet.get("workers", []):  # a worker without streams is in no row above
        for st in w.get("states", []):
            if st["state"] != "watching":
                out.append(
                    f"worker {w['worker_id']} on {st['collector']}: {st['state']}: {st['reason']}"
                )
    for src in fleet.get("scheduler_sources", []):
        if src["state"] in ("down", "undecodable"):
            out.append(
                f"scheduler source {src['source']} of {src['worker_id']} on {src['collector']}: "
                f"{src['state']}: {src['reason']}"
            )
    strays = [u for u in fleet.get("unexpected", []) if u["active"]]
    for u in strays:
        out.append(
            f"publisher past the last rank: {u['worker_id']} {u['endpoint']} "
            f"({u['batches']} batches, would be rank {u['dp_rank']})"
        )
    up = sum(1 for s in streams if s["up"])
    out.append("")
    out.append(f"{up}/{len(streams)} streams up, {conditions_line(alerts)}")
    for a in alerts:
        labels = " ".join(f"{k}={v}" for k, v in a["labels"].items())
        since = f" since {_hms(a.get('since'))}" if a.get("since") else ""
        out.append(
            f"  {a['severity'].upper():8} {a['kind']:26} {labels}: {a['description']}{since}"
        )
        if a.get("runbook_url"):
            out.append(f"  {'':8} {'':26} runbook: {a['runbook_url']}")
        then = a.get("consequences") or []
        if then:
            out.append(f"  {'':8} follows from it (muted in Alertmanager under it):")
        for c in then:
            where = " ".join(f"{k}={v}" for k, v in c["labels"].items())
            out.append(f"  {'':8}   {c['severity'].upper():8} {c['kind']:20} {where}: "
                       f"{c['description']}")  # fmt: skip
    if events is not None:
        out.append("")
        out.append(f"recent events ({len(events)}):")
        for ev in events:
            where = " ".join(
                str(x) for x in (ev.get("worker_id"), ev.get("dp_rank")) if x is not None
            )
            out.append(f"  {_hms(ev.get('time'))}  {ev['kind']:<13} {where:<16} {ev['message']}")
    return "\n".join(out) + "\n"


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Fetch the API and print it; 1 with a critical condition active, 2 when unreachable."""
    out = out or sys.stdout
    base = base_url(str(args.url))

    def get(path: str) -> Any:
        return fetch(f"{base}{path}", args.timeout, args.user, args.cacert)

    try:
        streams = get("/api/v1/streams")
        alerts = get("/api/v1/alerts")
        fleet = get("/api/v1/fleet")
        events = get("/api/v1/events?limit=20") if args.events else None
    except FetchError as exc:
        print(f"kvobserve status: {exc}", file=sys.stderr)
        return 2
    if not (isinstance(streams, list) and isinstance(alerts, list) and isinstance(fleet, dict)):
        print(
            f"kvobserve status: {base} did not answer like a kvobserve aggregator", file=sys.stderr
        )
        return 2
    if args.json:
        doc: dict[str, Any] = {"streams": streams, "alerts": alerts, "fleet": fleet}
        if events is not None:
            doc["events"] = events
        out.write(json.dumps(doc, indent=2) + "\n")
    else:
        out.write(render(streams, alerts, fleet, events[:20] if events else events))
    # by the causes: what follows from one is not a reason of its own
    return 1 if any(a.get("severity") == "critical" for a in alerts) else 0
