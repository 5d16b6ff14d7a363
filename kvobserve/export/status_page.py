"""The status page: one self-refreshing HTML document, no scripts, no external assets."""

from __future__ import annotations

import time
from collections.abc import Iterable
from html import escape
from typing import Any

Json = dict[str, Any]

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
h1{font-size:1.4em;margin:0 0 .2em}h2{font-size:1.1em;margin:1.4em 0 .4em}
table{border-collapse:collapse;background:#fff}td,th{border:1px solid #ddd;padding:3px 8px}
th{background:#eee;text-align:left}td.n{text-align:right;font-variant-numeric:tabular-nums}
.ok{color:#17702a;font-weight:600}.bad{color:#b3141b;font-weight:600}.muted{color:#777}
.sev-critical{background:#fde2e2}.sev-warning{background:#fff3cd}.sev-info{background:#e7f1ff}
.grid td{width:7em;text-align:center;vertical-align:top;font-size:12px}
.own0{background:#f4b4b4}.own1{background:#bfe8c4}.ownN{background:#ffd98a}
.small{font-size:12px}
"""


def _e(value: object) -> str:
    return escape(str(value), quote=True)


def _table(head: Iterable[str], rows: list[str], empty: str) -> str:
    if not rows:
        return f'<p class="muted">{_e(empty)}</p>'
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _up(flag: bool | None) -> str:
    if flag is None:
        return '<td class="muted">-</td>'
    return '<td class="ok">up</td>' if flag else '<td class="bad">down</td>'


def _n(value: object, bad: bool = False) -> str:
    cls = "n bad" if bad else "n"
    return f'<td class="{cls}">{_e(value)}</td>'


def _age(seconds: float) -> str:
    return f"{seconds:.1f} s"


def _dup(flag: bool | None) -> str:
    if flag is None:
        return '<td class="muted">-</td>'
    return '<td class="bad">yes</td>' if flag else "<td>no</td>"


_ACTIVE, _IDLE = '<td class="bad">active</td>', "<td>idle</td>"


def _alerts(alerts: list[Json]) -> str:
    rows = []
    for a in alerts:
        labels = ", ".join(f"{k}={v}" for k, v in a["labels"].items())
        sev = _e(a["severity"])
        rows.append(
            f'<tr class="sev-{sev}" data-kind="{_e(a["kind"])}"><td>{sev}</td>'
            f"<td>{_e(a['kind'])}</td><td>{_e(labels)}</td><td>{_e(a['description'])}</td></tr>"
        )
    return _table(("severity", "condition", "labels", "description"), rows, "No active conditions.")


def _collectors(collectors: list[Json]) -> str:
    rows = [
        f"<tr><td>{_e(c['collector'])}</td>{_n(c['node_rank'])}<td>{_e(c['hostname'])}</td>"
        f"{_up(c['up'])}{_n(_age(c['age_s']), not c['up'])}"
        f"<td>{_e(', '.join(c['workers']))}</td><td>{_e(c['version'])}</td></tr>"
        for c in collectors
    ]
    head = ("collector", "node", "hostname", "state", "last snapshot", "workers", "version")
    return _table(head, rows, "No collector has reported yet.")


def _workers(workers: list[Json]) -> str:
    out = []
    for w in workers:
        cells = []
        for rank, owners in w["owners"].items():
            cls = "own0" if not owners else "own1" if len(owners) == 1 else "ownN"
            who = "<br>".join(_e(o) for o in owners) or "uncovered"
            cells.append(f'<td class="{cls}"><b>rank {_e(rank)}</b><br>{who}</td>')
        leaders = ", ".join(w["leaders"]) or "none"
        bad = len(w["leaders"]) != 1
        out.append(
            f'<h3 class="small">{_e(w["worker_id"])} &middot; dp_size {_e(w["dp_size"])} '
            f'&middot; scheduler leader: <span class="{"bad" if bad else "ok"}">'
            f"{_e(leaders)}</span></h3>"
            f'<table class="grid"><tr>{"".join(cells)}</tr></table>'
        )
    return "".join(out) or '<p class="muted">No workers declared.</p>'


def _usage(s: Json) -> str:
    u = s["usage_ratio"]
    if u is None:
        return '<td class="n muted">-</td>'
    return _n(f"{100 * u:.1f}%", u >= 0.95)


def _sched(source: str | None) -> str:
    """The rank's scheduler sources; `none` stands out: no capacity or usage from the engine."""
    if source is None:
        return '<td class="muted">-</td>'
    return f'<td class="{"muted" if source == "none" else "small"}">{_e(source)}</td>'


def _streams(streams: list[Json]) -> str:
    rows = []
    for s in streams:
        dup = s["duplicate_stream"]
        rows.append(
            f"<tr><td>{_e(s['worker_id'])}</td>{_n(s['dp_rank'])}{_n(s['node_rank'])}"
            f"<td>{_e(s['collector'])}</td>{_up(s['up'])}{_n(s['batches'])}"
            f"{_n(s['gaps'], s['gaps'] > 0)}{_n(s['lost'], s['lost'] > 0)}"
            f"{_n(s['restarts'])}"
            f"{_dup(dup)}"
            f"{_usage(s)}{_sched(s.get('scheduler_source'))}"
            f"<td class='small'>{_e(s['endpoint'])}</td></tr>"
        )
    head = (
        "worker rank node collector state batches gaps lost restarts duplicate usage scheduler"
        " endpoint"
    )
    return _table(head.split(), rows, "No streams.")


def _unexpected(items: list[Json]) -> str:
    rows = [
        f"<tr><td>{_e(u['worker_id'])}</td>{_n(u['dp_rank'])}{_n(u['node_rank'])}"
        f"<td>{_e(u['endpoint'])}</td>{_n(u['batches'])}"
        f"{_ACTIVE if u['active'] else _IDLE}</tr>"
        for u in items
    ]
    return _table(("worker", "rank", "node", "endpoint", "batches", "state"), rows, "None.")


def render(
    fleet: Json, streams: list[Json], alerts: list[Json], *, generated: float, refresh_s: float
) -> str:
    """The whole page from the /api/v1 documents; every value is HTML-escaped."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(generated))
    up = sum(1 for s in streams if s["up"])
    crit = sum(1 for a in alerts if a["severity"] == "critical")
    summary = (
        f"{len(fleet['collectors'])} collectors, {len(fleet['workers'])} workers, "
        f"{up}/{len(streams)} streams up, {len(alerts)} active conditions ({crit} critical)"
    )
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f'<meta http-equiv="refresh" content="{max(1, int(refresh_s))}">'
        f"<title>kvobserve fleet</title><style>{_CSS}</style></head><body>"
        f'<h1>kvobserve fleet</h1><p class="muted" id="summary">{_e(summary)} &middot; '
        f"{_e(stamp)} &middot; <a href=/metrics>/metrics</a> &middot; "
        "<a href=/api/v1/streams>streams</a> &middot; <a href=/api/v1/alerts>alerts</a></p>"
        f'<h2>Active conditions</h2><div id="alerts">{_alerts(alerts)}</div>'
        f'<h2>Nodes</h2><div id="collectors">{_collectors(fleet["collectors"])}</div>'
        f'<h2>Workers and DP-rank owners</h2><div id="workers">{_workers(fleet["workers"])}</div>'
        f'<h2>Streams</h2><div id="streams">{_streams(streams)}</div>'
        f'<h2>Unexpected streams</h2><div id="unexpected">{_unexpected(fleet["unexpected"])}</div>'
        "</body></html>"
    )
