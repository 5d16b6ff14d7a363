"""Dashboards agree with the alert rules (issue 21, "nothing false").

Every panel of dashboards/*.json that has red in it (a threshold step, a value mapping, a fixed
colour) must draw red exactly where an alert it names fires, on the series that alert's rule
watches, at the rule's threshold; every panel that names an alert must query a series of that
alert's rule, or say plainly that it is context for it ("context for <Alert>, not its signal").
A warm prefix cache is about 100% full by design, so cache usage is never red.
"""

from __future__ import annotations

import copy
import json
import operator
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.test_dashboards import _metric_names

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
RULES = {
    r["alert"]: r["expr"]
    for g in yaml.safe_load((ROOT / "alerts" / "kvobserve-rules.yml").read_text())["groups"]
    for r in g["rules"]
}
OPS: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "==": operator.eq,
}  # fmt: skip
# A rule's signal: the first `metric OP number` or `increase(metric[window]) OP number` in it.
_SIGNAL = re.compile(
    r"(?:increase\((kvobserve_\w+)\[(\w+)\]\)|\b(kvobserve_\w+))\s*(==|>=|<=|>|<)\s*([0-9.]+)"
)
_MATCHERS = re.compile(r"\{[^}]*\}")
Panel = dict[str, Any]


@dataclass(frozen=True)
class Signal:
    """What an alert's rule compares: `lhs op threshold`, lhs a metric or its increase()."""

    metric: str
    window: str | None
    op: str
    text: str  # the threshold as written

    @property
    def lhs(self) -> str:
        return f"increase({self.metric}[{self.window}])" if self.window else self.metric

    @property
    def threshold(self) -> float:
        return float(self.text)


def signal(alert: str) -> Signal | None:
    """The signal of an alert's rule, None when it is no simple comparison (e.g. a ratio)."""
    m = _SIGNAL.search(RULES[alert])
    if m is None:
        return None
    inc, window, plain, op, value = m.groups()
    return Signal(inc or plain, window, op, value)


def forms(s: Signal) -> list[tuple[str, list[float], Callable[[float], bool]]]:
    """(expression without matchers and spaces, values to probe, where the rule fires) for the
    ways a panel may show an alert's signal."""
    t, fires = s.threshold, OPS[s.op]
    lhs = s.lhs
    near = [t - 1, t - 0.01, t + 0.01, t + 1, 0.0, 1.0, 2.0]
    out = [(lhs, near, lambda x: fires(x, t)), (f"sort_desc({lhs})", near, lambda x: fires(x, t))]
    cond = f"{lhs}{s.op}{s.text}"
    # how many series are past the threshold (a count of firing series)
    for count in (f"count({cond})orvector(0)", f"count({cond})"):
        out.append((count, [0.0, 1.0, 2.0, 5.0], lambda x: x >= 1))
    if s.op == "==" and t == 0:  # a 0/1 health gauge (or a count) that fires at 0
        out[0] = (lhs, [0.0, 1.0, 2.0], lambda x: x == 0)
        for share in (f"sum({lhs})/count({lhs})", f"min({lhs})", f"avg({lhs})"):
            out.append((share, [0.0, 0.5, 0.99, 1.0], lambda x: x < 1))
    if s.window and s.op == ">" and t == 0:  # any increase in the rule's window, counted up
        out.append((f"ceil(sum({lhs}))orvector(0)", [0.0, 1.0, 2.0], lambda x: x >= 1))
    return out


def _bare(expr: str) -> str:
    return re.sub(r"\s+", "", _MATCHERS.sub("", expr))


def is_red(color: str | None) -> bool:
    """Grafana's reds by name (red, dark-red, semi-dark-red, light-red, ...) or a red hex."""
    if not color:
        return False
    if "red" in color.lower():
        return True
    m = re.fullmatch(r"#([0-9a-fA-F]{6})", color)
    if m is None:
        return False
    r, g, b = (int(m.group(1)[i : i + 2], 16) for i in (0, 2, 4))
    return r > 150 and r > 2 * g and r > 2 * b


def _colors(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("color", "fixedColor") and isinstance(v, str):
                yield v
            else:
                yield from _colors(v)
    elif isinstance(node, list):
        for v in node:
            yield from _colors(v)


def has_red(panel: Panel) -> bool:
    return any(is_red(c) for c in _colors(panel.get("fieldConfig", {})))


def color_at(panel: Panel, x: float) -> str | None:
    """The colour Grafana gives value `x`: a value or range mapping first, then a fixed colour,
    then the threshold step it falls in."""
    d = panel.get("fieldConfig", {}).get("defaults", {})
    for m in d.get("mappings", []):
        if m["type"] == "value":
            for key, res in m["options"].items():
                if float(key) == x and "color" in res:
                    return str(res["color"])
        elif m["type"] == "range":
            o = m["options"]
            lo, hi = o.get("from"), o.get("to")
            if (lo is None or x >= lo) and (hi is None or x <= hi) and "color" in o["result"]:
                return str(o["result"]["color"])
    color = d.get("color", {})
    if color.get("mode") == "fixed":
        return str(color.get("fixedColor"))
    got = None
    for step in d.get("thresholds", {}).get("steps", []):
        if step["value"] is None or x >= step["value"]:
            got = step["color"]
    return got


def named_alerts(panel: Panel) -> list[str]:
    text = f"{panel.get('title', '')} {panel.get('description', '')}"
    return [a for a in RULES if re.search(rf"\b{a}\b", text)]


def problems(panel: Panel) -> list[str]:
    """What is wrong with one panel, in words (empty: it agrees with the rules)."""
    out = []
    title = panel.get("title", "?")
    exprs = [t["expr"] for t in panel.get("targets", []) if t.get("expr")]
    used = set().union(*(_metric_names(e) for e in exprs)) if exprs else set()
    desc = panel.get("description", "").lower()
    named = named_alerts(panel)
    for a in named:
        if not used & _metric_names(RULES[a]) and f"context for {a.lower()}" not in desc:
            out.append(
                f"{title!r} names {a} but queries none of its rule's series "
                f"({sorted(_metric_names(RULES[a]))}) and does not say it is context for it"
            )
    overrides = panel.get("fieldConfig", {}).get("overrides", [])
    if any(is_red(c) for c in _colors(overrides)):
        out.append(f"{title!r}: red in an override (not checked here: put it in the defaults)")
    if not has_red(panel):
        return out
    fits = []
    for a in named:
        s = signal(a)
        if s is None:
            continue
        for form, probes, fires in forms(s):
            if exprs and all(_bare(e) == form for e in exprs):
                wrong = [x for x in probes if is_red(color_at(panel, x)) != fires(x)]
                fits.append((a, form, wrong))
    if not fits:
        out.append(
            f"{title!r} has red but its description names no alert whose signal it shows "
            f"(named: {named or 'none'}; queries: {exprs})"
        )
    elif not any(not wrong for _, _, wrong in fits):
        out.append(
            f"{title!r}: red where its alert does not fire, or not red where it does: "
            + "; ".join(f"{a} as {form}: wrong at {wrong}" for a, form, wrong in fits)
        )
    return out


def _panels(path: Path) -> Iterator[Panel]:
    stack = list(json.loads(path.read_text())["panels"])
    while stack:
        p = stack.pop(0)
        stack.extend(p.get("panels", []))
        if p.get("type") != "row":
            yield p


def _checked() -> list[tuple[str, Panel]]:
    return [
        (f"{path.name}#{p['id']}", p)
        for path in DASHBOARDS
        for p in _panels(path)
        if has_red(p) or named_alerts(p)
    ]


CHECKED = _checked()


@pytest.mark.parametrize(("where", "panel"), CHECKED, ids=[w for w, _ in CHECKED])
def test_panel_agrees_with_the_rules(where: str, panel: Panel) -> None:
    assert problems(panel) == [], where


def test_the_checked_panels_include_the_alert_signals() -> None:
    """Not vacuous: the red panels cover the paging alerts' signals, and the one that warns of
    a full cache sits on token usage."""
    red = {w: p for w, p in CHECKED if has_red(p)}
    assert len(red) >= 10 and len(CHECKED) > len(red)
    on = {a for p in red.values() for a in named_alerts(p)}
    assert {"KVEventStreamDown", "KVEventsLost", "DPRankUncovered", "KVObserveCollectorDown",
            "KVCacheNearFull"} <= on  # fmt: skip
    near_full = [p for p in red.values() if "KVCacheNearFull" in named_alerts(p)]
    assert near_full and all(
        _metric_names(t["expr"]) == {"kvobserve_scheduler_token_usage_ratio"}
        for p in near_full
        for t in p["targets"]
    )


def test_cache_usage_is_drawn_neutral() -> None:
    """Every panel of kvobserve_kv_cache_usage_ratio has no red, no orange, no threshold line."""
    seen = 0
    for path in DASHBOARDS:
        for p in _panels(path):
            if not any("kvobserve_kv_cache_usage_ratio" in t.get("expr", "") for t in p["targets"]):
                continue
            seen += 1
            colors = set(_colors(p.get("fieldConfig", {})))
            assert not any(is_red(c) or c == "orange" for c in colors), (path.name, p["title"])
            style = p["fieldConfig"]["defaults"].get("custom", {}).get("thresholdsStyle", {})
            assert style.get("mode", "off") == "off", (path.name, p["title"])
    assert seen >= 4


def _fleet_panel(title: str) -> Panel:
    return next(p for p in _panels(ROOT / "dashboards/kvobserve-fleet.json") if p["title"] == title)


def test_the_check_bites() -> None:
    """Today's panels made wrong the ways issue 21 found them, or nearly so, are reported."""
    usage = copy.deepcopy(_fleet_panel("Cache usage per rank"))
    usage["description"] = "GPU-tier resident tokens / capacity. KVCacheNearFull fires above 95%."
    usage["fieldConfig"]["defaults"]["thresholds"]["steps"] = [
        {"color": "green", "value": None},
        {"color": "red", "value": 0.95},
    ]
    assert any("queries none of its rule's series" in m for m in problems(usage))
    assert any("has red" in m for m in problems(usage))
    token = copy.deepcopy(_fleet_panel("Token usage per rank"))
    token["fieldConfig"]["defaults"]["thresholds"]["steps"][1]["value"] = 0.9  # not the rule's
    assert any("KVCacheNearFull as kvobserve_scheduler_token_usage_ratio: wrong at" in m
               for m in problems(token))  # fmt: skip
    assert problems(_fleet_panel("Token usage per rank")) == []
    up = copy.deepcopy(_fleet_panel("Streams up"))
    up["fieldConfig"]["defaults"]["thresholds"]["steps"].insert(
        1, {"color": "orange", "value": 0.5}
    )
    assert any("wrong at [0.5, 0.99]" in m for m in problems(up))  # orange while a stream is down
    hex_red = copy.deepcopy(_fleet_panel("Current cache usage by rank"))
    hex_red["fieldConfig"]["defaults"]["color"] = {"mode": "fixed", "fixedColor": "#E02F44"}
    assert problems(hex_red)
