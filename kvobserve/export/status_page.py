"""The status page: one self-refreshing HTML document, no scripts, no external assets.

Built from the /api/v1 documents. Colour follows the active conditions only: a cell is tinted
with the severity of the condition it belongs to (a stream's state with stream_down, its gaps with
sequence_gap or events_lost, ...: each kind's `cell` in analysis/conditions.py), never because a
number is large: a warm prefix cache is full by design. The conditions table lists causes; what
follows from a cause (a lost collector's streams and ranks, ...) is listed under it, smaller, as
/api/v1/alerts nests it. Every condition links to its runbook section.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from html import escape
from typing import Any

from kvobserve.analysis.conditions import KINDS, severity_rank
from kvobserve.export.api import every_alert

Json = dict[str, Any]

_CSS = """
body{font:13px/1.4 system-ui,sans-serif;margin:1.2em 1.5em;color:#222;background:#fafafa}
h1{font-size:1.4em;margin:0 0 .2em}h2{font-size:1.1em;margin:1.3em 0 .4em}
table{border-collapse:collapse;background:#fff}td,th{border:1px solid #ddd;padding:3px 6px;
vertical-align:top}th{background:#eee;text-align:left;font-weight:600;white-space:nowrap}
td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.muted{color:#777}.small{font-size:11px}.nw{white-space:nowrap}
.ok{color:#17702a;font-weight:600}.st{font-weight:600}
.c-critical{background:#fde2e2}.c-warning{background:#fff3cd}.c-info{background:#e7f1ff}
.sev{display:inline-block;padding:0 6px;border-radius:3px;font-weight:600;font-size:11px}
.sev-critical{background:#b3141b;color:#fff}.sev-warning{background:#e8a400;color:#222}
.sev-info{background:#2f6fdf;color:#fff}
.grid td{width:7em;text-align:center;font-size:12px}
.own0{background:#f4b4b4}.own1{background:#bfe8c4}.ownN{background:#ffd98a}
tr.follows td{border-top:none;padding:0 6px 6px}
table.sub{margin-left:1.6em;background:transparent;font-size:12px}
table.sub td{border:none;border-top:1px solid #eee;padding:1px 8px 1px 0}
table.sub .sev{font-size:10px;padding:0 4px;opacity:.8}
.follows-head{font-size:11px;color:#555;margin:2px 0 0 1.6em}
"""

# The rows a kind's `cell` names besides a stream's cells, and the labels that pick the row.
_ROW_KEYS = {
    "worker": ("worker_id", "collector"),
    "source": ("worker_id", "collector", "source"),
    "pool": ("pool",),
}


def _cell(kind: str) -> str | None:
    """What a condition of `kind` tints (analysis/conditions.py `Kind.cell`)."""
    k = KINDS.get(kind)
    return k.cell if k is not None else None


def _html(value: object) -> str:
    """`value` as HTML text (quotes escaped too: it goes into attributes as well)."""
    return escape(str(value), quote=True)


def _table(head: Iterable[str], rows: list[str], empty: str, tid: str = "") -> str:
    if not rows:
        return f'<p class="muted">{_html(empty)}</p>'
    th = "".join(f"<th>{_html(h)}</th>" for h in head)
    idattr = f' id="{tid}"' if tid else ""
    return f"<table{idattr}><thead><tr>{th}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


class _Clock:
    """Formats wall-clock times against the page's own time."""

    def __init__(self, now: float) -> None:
        self.now = now

    def ago(self, t: float | None) -> str:
        if not t:
            return "-"
        d = max(0.0, self.now - t)
        if d < 90:
            rel = f"{d:.0f} s ago"
        elif d < 5400:
            rel = f"{d / 60:.0f} min ago"
        else:
            rel = f"{d / 3600:.1f} h ago"
        return f"{time.strftime('%H:%M:%S', time.gmtime(t))} ({rel})"

    @staticmethod
    def hms(t: float | None) -> str:
        return time.strftime("%H:%M:%S", time.gmtime(t)) if t else "-"


def _sev(severity: str) -> str:
    return f'<span class="sev sev-{_html(severity)}">{_html(severity)}</span>'


def _where(labels: Json) -> str:
    parts = []
    if "worker_id" in labels:
        parts.append(str(labels["worker_id"]))
    if "dp_rank" in labels:
        parts.append(f"rank {labels['dp_rank']}")
    if "node_rank" in labels:
        parts.append(f"node {labels['node_rank']}")
    for k in ("collector", "endpoint"):
        if k in labels:
            parts.append(str(labels[k]))
    if "pool" in labels:
        parts.append(f"pool {labels['pool']}")
    return " · ".join(parts)


def _link(a: Json) -> str:
    if not a.get("runbook_url"):
        return ""
    return f'<a href="{_html(a["runbook_url"])}">{_html(a["alert"])}</a>'


def _alerts(alerts: list[Json], clock: _Clock) -> str:
    """One row per cause; what follows from it in a row beneath, as a smaller table."""
    rows = []
    for a in alerts:
        rows.append(
            f'<tr class="c-{_html(a["severity"])}" data-kind="{_html(a["kind"])}">'
            f"<td>{_sev(a['severity'])}</td><td><b>{_html(a.get('title', a['kind']))}</b><br>"
            f'<span class="small muted">{_html(a["kind"])}</span></td>'
            f'<td class="nw">{_html(_where(a["labels"]))}</td><td>{_html(a["description"])}</td>'
            f'<td class="nw">{_html(clock.ago(a.get("since")))}</td><td>{_link(a)}</td></tr>'
        )
        then = a.get("consequences") or []
        if then:
            rows.append(_consequences(a, then))
    head = ("severity", "condition", "where", "what", "since", "runbook")
    return _table(head, rows, "No active conditions.", "alerts-table")


def _consequences(cause: Json, then: list[Json]) -> str:
    """The conditions that follow from `cause`: their kinds counted, then one line each."""
    kinds: dict[str, int] = {}
    for a in then:
        kinds[a["kind"]] = kinds.get(a["kind"], 0) + 1
    said = ", ".join(f"{n} {_html(k)}" for k, n in kinds.items())
    lines = "".join(
        f'<tr data-kind="{_html(a["kind"])}"><td>{_sev(a["severity"])}</td>'
        f"<td class=nw>{_html(a.get('title', a['kind']))}</td>"
        f'<td class="nw">{_html(_where(a["labels"]))}</td><td>{_html(a["description"])}</td>'
        f"<td>{_link(a)}</td></tr>"
        for a in then
    )
    return (
        f'<tr class="follows c-{_html(cause["severity"])}" '
        f'data-cause="{_html(cause["kind"])}"><td></td><td colspan=5>'
        f'<p class="follows-head">follows from it, muted in Alertmanager under it: {said}</p>'
        f'<table class="sub">{lines}</table></td></tr>'
    )


def _stream_conditions(alerts: list[Json]) -> dict[tuple[str, str, str], dict[str, str]]:
    """(worker, node, rank) -> cell -> the most severe condition severity tinting it."""
    out: dict[tuple[str, str, str], dict[str, str]] = {}
    for a in every_alert(alerts):
        lb, cell = a["labels"], _cell(a["kind"])
        if cell is None or cell in _ROW_KEYS or "dp_rank" not in lb:
            continue
        key = (str(lb.get("worker_id")), str(lb.get("node_rank")), str(lb.get("dp_rank")))
        cells = out.setdefault(key, {})
        if cell not in cells or severity_rank(a["severity"]) < severity_rank(cells[cell]):
            cells[cell] = a["severity"]
    return out


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _secs(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.1f} s"


def _stream_row(s: Json, cond: dict[str, str], clock: _Clock) -> str:
    def td(cell: str, body: str, num: bool = False) -> str:
        cls = " ".join(
            c for c in ("n" if num else "", f"c-{cond[cell]}" if cell in cond else "") if c
        )
        return f'<td class="{cls}">{body}</td>' if cls else f"<td>{body}</td>"

    state = s.get("state") or ("up" if s["up"] else "down")
    cls = "ok" if state == "up" else "st"
    since = clock.ago(s.get("state_since"))
    reason = (
        f'{_html(s.get("reason") or "")}<br><span class="small muted">since {_html(since)}</span>'
    )
    gaps = f"{s['gaps']}"
    if s["gaps"]:
        gaps += f'<br><span class="small">{s["recovered"]} recovered, {s["lost"]} lost'
        gaps += f"<br>last {_html(clock.hms(s.get('last_gap_time')))}</span>"
    restarts = f"{s['restarts']}"
    if s["restarts"]:
        restarts += (
            f'<br><span class="small">last {_html(clock.hms(s.get("last_restart_time")))}</span>'
        )
    if s["duplicate_stream"]:
        dup = f'yes<br><span class="small">{_html(clock.hms(s.get("last_duplicate_time")))}</span>'
    else:  # None: the stream is not up, so it is not known now
        dup = "-" if s["duplicate_stream"] is None else "no"
        if s.get("last_duplicate_time"):
            last = _html(clock.hms(s["last_duplicate_time"]))
            dup += f'<br><span class="small muted">last {last}</span>'
    complete = s["state_complete"] if s["batches"] else None  # no batch yet: nothing to judge
    if not s["batches"] and not s["duplicate_stream"]:
        dup = "-"
    index = "-" if complete is None else "exact" if complete else "lower bound"
    if s.get("trust") and s["batches"]:  # docs/cache-analytics.md, "Trust state"
        index = f'{_html(s["trust"])}<br><span class="small">{_html(s.get("trust_reason") or "")}</span>'
    elif complete is False and s.get("incomplete_reason"):
        index += f'<br><span class="small">{_html(s["incomplete_reason"])}</span>'
    evidence = ", ".join(
        f"{_html(k)} {_html(n)}" for k, n in sorted(s.get("silent_loss", {}).items())
    )
    if s.get("over_capacity"):
        evidence = ", ".join(x for x in (evidence, "over capacity") if x)
    if evidence:
        index += f'<br><span class="small st">silent loss: {evidence}</span>'
    errs = sum(s["decode_errors"].values())
    errors = f"{errs}" + (
        f" / {s['rank_mismatch_batches']} rank" if s["rank_mismatch_batches"] else ""
    )
    eps = s.get("events_per_s")
    state_cell = td("state", f'<span class="{cls}">{_html(state)}</span>')
    return (
        f'<tr data-rank="{_html(s["dp_rank"])}" data-state="{_html(state)}">'
        f"<td>{_html(s['worker_id'])}</td><td class=n>{_html(s['dp_rank'])}</td>"
        f"<td class=n>{_html(s['node_rank'])}</td>"
        f"{state_cell}<td>{reason}</td>"
        f"<td class=n>{_html(s['batches'])}</td>"
        f"<td class=n>{'-' if eps is None else f'{eps:,.0f}'}</td>"
        f"<td class=n>{_secs(s.get('lag_seconds'))}</td>"
        f"<td class=n>{_secs(s.get('last_message_age_s'))}</td>"
        f"{td('gaps', gaps, True)}{td('restarts', restarts, True)}{td('dup', dup)}"
        f"{td('index', index)}{td('errors', errors, True)}"
        f"<td class=n>{_usage(s)}</td>"
        f"{td('sched', _pct(s.get('token_usage_ratio')) + _via(s), True)}"
        f'<td class="small">{_html(s["endpoint"])}<br>{_html(s["collector"])}</td></tr>'
    )


def _usage(s: Json) -> str:
    """The cache-usage cell: the share, or while the index cannot vouch for it what is
    certainly resident and why ("-" while the stream is down)."""
    un = s.get("unvouched")
    if not un:
        return _pct(s.get("cache_usage_ratio"))
    lower = un["lower_bound"]["tokens"]
    return (
        f'<span title="{_html(un["reason"])}">&ge; {lower:,} tok</span>'
        f'<br><span class="muted small">unvouched</span>'
    )


def _via(s: Json) -> str:
    """Which scheduler sources report the rank; `none` stands out: no usage from the engine."""
    src = s.get("scheduler_source")
    if src is None:
        return ""
    return f'<br><span class="small{" muted" if src != "none" else ""}">{_html(src)}</span>'


def _streams(streams: list[Json], alerts: list[Json], clock: _Clock) -> str:
    conds = _stream_conditions(alerts)
    rows = [
        _stream_row(
            s, conds.get((str(s["worker_id"]), str(s["node_rank"]), str(s["dp_rank"])), {}), clock
        )
        for s in streams
    ]
    head = (
        "worker", "rank", "node", "state", "reason", "batches", "events/s", "lag",
        "last batch", "gaps", "restarts", "duplicate", "index", "errors",
        "cache usage", "token usage", "endpoint · collector",
    )  # fmt: skip
    return _table(head, rows, "No streams.", "streams-table")


def _events(events: list[Json], clock: _Clock) -> str:
    rows = []
    for ev in events:
        sev = ev.get("severity")
        tint = f' class="c-{_html(sev)}"' if sev and ev.get("state") == "firing" else ""
        where = _where(ev.get("labels") or ev)
        rows.append(
            f'<tr{tint} data-kind="{_html(ev["kind"])}"><td class="nw">{_html(clock.ago(ev["time"]))}</td>'
            f"<td>{_html(ev['kind'])}</td><td class=nw>{_html(where)}</td><td>{_html(ev['message'])}</td></tr>"
        )
    return _table(("time (UTC)", "kind", "where", "what"), rows, "No events yet.", "events-table")


def _strays(items: list[Json]) -> str:
    active = [u for u in items if u["active"]]
    rows = [
        f'<tr class="c-warning"><td>{_html(u["worker_id"])}</td><td class=n>{_html(u["dp_rank"])}</td>'
        f"<td class=n>{_html(u['node_rank'])}</td><td>{_html(u['endpoint'])}</td>"
        f"<td class=n>{_html(u['batches'])}</td></tr>"
        for u in active
    ]
    head = ("worker", "would-be rank", "node", "endpoint", "batches")
    out = _table(head, rows, "No publisher past the last rank.", "strays-table")
    idle = [u["endpoint"] for u in items if not u["active"]]
    if idle:
        out += (
            f'<p class="small muted" id="idle-probes">Idle probe ports past the last rank '
            f"(nothing publishes there, as it should be): {_html(', '.join(idle))}</p>"
        )
    return out


def _row_conditions(alerts: list[Json]) -> dict[tuple[str, ...], str]:
    """(kind's row keys: worker, collector[, source]) -> the severity tinting that row."""
    out: dict[tuple[str, ...], str] = {}
    for a in every_alert(alerts):
        keys = _ROW_KEYS.get(_cell(a["kind"]) or "")
        if keys is not None:
            out[tuple(str(a["labels"].get(k)) for k in keys)] = a["severity"]
    return out


def _tint(severity: str | None) -> str:
    return f' class="c-{_html(severity)}"' if severity else ""


def _sources(sources: list[Json], clock: _Clock, alerts: list[Json]) -> str:
    conds = _row_conditions(alerts)
    rows = [
        f"<tr><td>{_html(s['worker_id'])}</td><td>{_html(s['source'])}</td>"
        f'<td class="small">{_html(s["endpoint"])}</td><td>{_html(s["collector"])}</td>'
        f"<td{_tint(conds.get((str(s['worker_id']), str(s['collector']), str(s['source']))))}>"
        f'<span class="{"ok" if s["state"] == "up" else "st"}">{_html(s["state"])}</span></td>'
        f"<td>{_html(s['reason'])}</td><td class=nw>{_html(clock.ago(s.get('since')))}</td>"
        f"<td class=n>{_html(s['messages'])}</td></tr>"
        for s in sources
    ]
    head = ("worker", "source", "endpoint", "collector", "state", "reason", "since", "messages")
    return _table(
        head,
        rows,
        "No scheduler or discovery sources (no leader with metrics_url, url or a side channel, "
        "no [worker.kubernetes]).",
    )


def _binds(binds: list[Json], clock: _Clock) -> str:
    """Bind mode: each bound endpoint, who is connected, and its relay (when it has one)."""
    rows = []
    for b in binds:
        r = b["relay"]
        skipped = ", ".join(f"{k} {n}" for k, n in sorted(b["skipped"].items()))
        relay = "-"
        if r is not None:
            dropped = ", ".join(f"{k} {n}" for k, n in sorted(r["dropped"].items()))
            relay = (
                f'<span class="{"ok" if r["state"] == "up" else "st"}">{_html(r["state"])}</span> '
                f"{_html(r['target'])}: {_html(r['reason'])} ({_html(clock.ago(r['since']))}); "
                f"{_html(r['forwarded'])} forwarded"
                + (f", dropped {_html(dropped)}" if dropped else "")
            )
        cls = "" if r is None or not r["dropped"] else ' class="c-warning"'
        rows.append(
            f"<tr{cls}><td>{_html(b['worker_id'])}</td><td class=n>{_html(b['dp_rank'])}</td>"
            f"<td>{_html(b['endpoint'])}</td><td>{_html(b['topic'])}</td>"
            f'<td class="{"ok" if b["state"] == "connected" else "st"}">{_html(b["state"])}</td>'
            f"<td>{_html(b['reason'])}</td><td class=n>{_html(b['streams'])}</td>"
            f"<td class=n>{_html(b['messages'])}</td>"
            f'<td class="small">{_html(skipped or "-")}'
            + (f"<br>{_html(b['skip_reason'])}" if skipped and b["skip_reason"] else "")
            + f'</td><td class="small">{relay}</td></tr>'
        )
    head = ("worker", "rank", "bound", "topic", "state", "reason", "streams", "messages",
            "skipped", "relay")  # fmt: skip
    return _table(head, rows, "No bound endpoint.", "binds-table")


def _collectors(collectors: list[Json]) -> str:
    rows = [
        f"<tr{'' if c['up'] else ' class=c-critical'}><td>{_html(c['collector'])}</td>"
        f"<td class=n>{_html(c['node_rank'])}</td><td>{_html(c['hostname'])}</td>"
        f'<td class="{"ok" if c["up"] else "st"}">{"up" if c["up"] else "down"}</td>'
        f"<td class=n>{c['age_s']:.1f} s</td>"
        f"<td>{_html(', '.join(c['workers']))}</td><td>{_html(c['version'])}</td></tr>"
        for c in collectors
    ]
    head = ("collector", "node", "hostname", "state", "last snapshot", "workers", "version")
    return _table(head, rows, "No collector has reported yet.")


HOT_SHOWN = 5  # hot prefixes per worker on the page (/api/v1/hot lists more)


def _stores(b: Json) -> str:
    """A hot prefix's store count, with its upper bound when the count may fall short."""
    lo, hi = b["stores"], b["stores_max"]
    return f"{_html(lo)}" if hi == lo else f"{_html(lo)} &ndash; {_html(hi)}"


def _hot(hot: Json | None) -> str:
    """Per worker: its top hot prefixes (hashes, store counts, ranks holding them) and placement."""
    out = []
    for w in (hot or {}).get("workers", []):
        p = w.get("placement") or {}
        ratio = p.get("redundancy")
        place = (
            f" &middot; redundancy {ratio:.2f} &middot; recomputed elsewhere "
            f"{_html(p.get('recomputed_elsewhere', 0))}"
            if ratio is not None
            else ""
        )
        rows = [
            f'<tr><td class="small">{_html(b["hash"])}</td><td class=n>{_stores(b)}</td>'
            f"<td class=n>{_html(b['holders'])}</td></tr>"
            for b in w["blocks"][:HOT_SHOWN]
        ]
        out.append(
            f'<h3 class="small">{_html(w["worker_id"])}{place}</h3>'
            + _table(("block hash", "stores", "ranks holding"), rows, "No hot prefixes yet.")
        )
    return "".join(out) or '<p class="muted">No cache analytics.</p>'


def _pct1(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _misses(misses: Json | None, alerts: list[Json]) -> str:
    """Per pool (and its workers): the shares of the misses by kind with their bound and trust,
    and over the last window the placement share, the hit rate, a perfect router's and what
    unlimited capacity adds."""
    conds = _row_conditions(alerts)
    rows = []
    for p in (misses or {}).get("pools", []):
        sh, r = p["shares"], p["recent"] or {}
        trust = (
            '<span class="ok">trusted</span>'
            if p["trusted"]
            else f'<span class="st">not trusted:</span> <span class="small">'
            f"{_html(p['reason'])}</span>"
        )
        window = (r.get("shares") or {}).get("placement")
        rows.append(
            f'<tr{_tint(conds.get((str(p["pool"]),)))} data-pool="{_html(p["pool"])}">'
            f"<td class=nw><b>{_html(p['pool'])}</b></td>"
            + "".join(f"<td class=n>{_pct1(sh[k])}</td>" for k in _KINDS)
            + f"<td class=n>&plusmn;{_pct1(p['bound'])}</td><td class=n>{_html(p['sampled'])}"
            f"</td><td>{trust}</td><td class=n>{_pct1(window)}</td>"
            f"<td class=n>{_pct1(r.get('hit_rate'))}</td>"
            f"<td class=n>{_pct1(r.get('perfect_router_hit_rate'))}</td>"
            f"<td class=n>{_pct1(r.get('unlimited_capacity_adds'))}</td></tr>"
        )
        for w in p["workers"]:
            m = w["misses"]
            total = sum(m.values())
            shares = "".join(
                f"<td class=n>{_pct1(m[k] / total if total else None)}</td>" for k in _KINDS
            )
            hits = w["hit_blocks"]
            said = f"{total:,.0f} misses" + (f", {hits:,.0f} hits" if hits is not None else "")
            rows.append(
                f'<tr class="small"><td class=nw>&nbsp;&nbsp;worker {_html(w["worker_id"])}</td>'
                f'{shares}<td colspan=7 class="muted">{_html(said)} (blocks, since the '
                "aggregator started)</td></tr>"
            )
    head = ("pool", "compulsory", "capacity", "placement", "bound (99 %)", "sampled", "trust",
            "placement, 15 min", "hit rate, 15 min", "perfect router", "+ unlimited capacity")  # fmt: skip
    return _table(
        head, rows, "No miss split (no pool with the cache analytics on yet).", "misses-table"
    )


_KINDS = ("compulsory", "capacity", "placement")
_FACTORS = ("0.5", "0.75", "1", "1.25", "1.5", "2", "4", "8", "+Inf")


def _capacity(capacity: Json | None) -> str:
    """Per pool: its hit rate as one global cache of each multiple of its memory, then per
    worker as routed (each rank's memory scaled); untrusted points in brackets, unknown -."""

    def cells(c: Json) -> str:
        got = {p["factor"]: p for p in c["points"]}
        out = []
        for f in _FACTORS:
            p = got.get(f)
            if p is None or p["hit_rate"] is None:
                out.append("<td class=n>-</td>")
                continue
            text = _pct1(p["hit_rate"])
            if "low" in p:
                text += f' <span class="small">({_pct1(p["low"])}&ndash;{_pct1(p["high"])})</span>'
            cls = "n" if p["trusted"] else "n muted"
            out.append(f'<td class="{cls}" title="{_html(p["rests_on"])}">'
                       f"{text if p['trusted'] else f'[{text}]'}</td>")  # fmt: skip
        return "".join(out)

    rows = []
    for p in (capacity or {}).get("pools", []):
        name = _html(p["pool"])
        if not p["available"]:
            rows.append(f'<tr data-pool="{name}"><td class=nw><b>{name}</b></td>'
                        f'<td colspan={len(_FACTORS) + 1} class="muted">{_html(p["reason"])}'
                        "</td></tr>")  # fmt: skip
            continue
        trust = "trusted" if p["trusted"] else f"not trusted: {p['reason'] or 'waiting'}"
        rows.append(f'<tr data-pool="{name}"><td class=nw><b>{name}</b> '
                    '<span class="small muted">one global cache</span></td>'
                    f'{cells(p)}<td class="small">{_html(trust)}</td></tr>')  # fmt: skip
        for w in p["workers"]:
            wt = (
                "as routed"
                if w["trusted"]
                else f"as routed; not trusted: {w['reason'] or 'waiting'}"
            )
            rows.append(f'<tr class="small"><td class=nw>&nbsp;&nbsp;worker '
                        f'{_html(w["worker_id"])}</td>{cells(w)}<td>{_html(wt)}</td></tr>')  # fmt: skip
    head = ("pool", *(f"x {f}" for f in _FACTORS), "trust")
    return _table(head, rows, "No capacity curve yet (a pool of a recency-evicting engine, "
                  "with the cache analytics on).", "capacity-table")  # fmt: skip


def _workers(workers: list[Json], alerts: list[Json], clock: _Clock) -> str:
    conds = _row_conditions(alerts)
    out = []
    for w in workers:
        cells = []
        for rank, owners in w["owners"].items():
            cls = "own0" if not owners else "own1" if len(owners) == 1 else "ownN"
            who = "<br>".join(_html(o) for o in owners) or "uncovered"
            cells.append(f'<td class="{cls}"><b>rank {_html(rank)}</b><br>{who}</td>')
        leaders = ", ".join(w["leaders"]) or "none"
        grid = (
            f'<table class="grid"><tr>{"".join(cells)}</tr></table>'
            if cells
            else '<p class="small muted">No rank known.</p>'
        )
        # each live collector's word on the worker: why it watches nothing, or other ranks
        states = [
            f"<tr{_tint(conds.get((str(w['worker_id']), str(st['collector']))))} "
            f'data-state="{_html(st["state"])}"><td>{_html(st["collector"])}</td>'
            f'<td><span class="{"ok" if st["state"] == "watching" else "st"}">'
            f"{_html(st['state'])}</span></td><td>{_html(st['reason'])}</td>"
            f"<td class=nw>{_html(clock.ago(st.get('since')))}</td></tr>"
            for st in w.get("states", [])
        ]
        out.append(
            f'<h3 class="small">{_html(w["worker_id"])} &middot; dp_size {_html(w["dp_size"])} '
            f"&middot; scheduler leader: {_html(leaders)}</h3>"
            + (_table(("collector", "state", "reason", "since"), states, "") if states else "")
            + grid
        )
    return "".join(out) or '<p class="muted">No workers declared.</p>'


def conditions_line(alerts: list[Json]) -> str:
    """`1 active condition (1 critical), 8 more follow from it`: the causes by severity."""
    by_sev = {
        sev: sum(1 for a in alerts if a["severity"] == sev)
        for sev in ("critical", "warning", "info")
    }
    counts = ", ".join(f"{n} {sev}" for sev, n in by_sev.items() if n) or "none"
    n = len(alerts)
    out = f"{n} active condition{'' if n == 1 else 's'} ({counts})"
    more = sum(len(a.get("consequences") or ()) for a in alerts)
    if more:
        out += f", {more} more follow from {'it' if n == 1 else 'them'}"
    return out


def render(
    fleet: Json,
    streams: list[Json],
    alerts: list[Json],
    *,
    generated: float,
    refresh_s: float,
    events: list[Json] | None = None,
    hot: Json | None = None,
    misses: Json | None = None,
    capacity: Json | None = None,
) -> str:
    """The whole page from the /api/v1 documents; every value is HTML-escaped."""
    clock = _Clock(generated)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(generated))
    up = sum(1 for s in streams if s["up"])
    summary = (
        f"{len(fleet['collectors'])} collectors, {len(fleet['workers'])} workers, "
        f"{up}/{len(streams)} streams up, {conditions_line(alerts)}"
    )
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f'<meta http-equiv="refresh" content="{max(1, int(refresh_s))}">'
        f"<title>kvobserve fleet</title><style>{_CSS}</style></head><body>"
        f'<h1>kvobserve fleet</h1><p class="muted" id="summary">{_html(summary)} &middot; '
        f"{_html(stamp)} &middot; <a href=/metrics>/metrics</a> &middot; "
        "<a href=/api/v1/streams>streams</a> &middot; <a href=/api/v1/alerts>alerts</a> "
        "&middot; <a href=/api/v1/events>events</a></p>"
        f'<h2>Active conditions</h2><div id="alerts">{_alerts(alerts, clock)}</div>'
        f'<h2>Streams</h2><div id="streams">{_streams(streams, alerts, clock)}</div>'
        f'<h2>Recent events</h2><div id="events">{_events((events or [])[:25], clock)}</div>'
        f'<h2>Publishers past the last rank</h2><div id="unexpected">'
        f"{_strays(fleet['unexpected'])}</div>"
        f'<h2>Scheduler and discovery sources</h2><div id="sources">'
        f"{_sources(fleet.get('scheduler_sources', []), clock, alerts)}</div>"
        + (
            f'<h2>Bound endpoints</h2><div id="binds">{_binds(fleet["binds"], clock)}</div>'
            if fleet.get("binds")
            else ""
        )
        + f'<h2>Where the misses come from</h2><div id="misses">{_misses(misses, alerts)}</div>'
        f'<h2>What more memory would buy</h2><div id="capacity">{_capacity(capacity)}</div>'
        f'<h2>Hot prefixes</h2><div id="hot">{_hot(hot)}</div>'
        f'<h2>Nodes</h2><div id="collectors">{_collectors(fleet["collectors"])}</div>'
        f'<h2>Workers and DP-rank owners</h2><div id="workers">'
        f"{_workers(fleet['workers'], alerts, clock)}</div>"
        "</body></html>"
    )
