"""The shipped Grafana dashboards: @grafana/schema type check, structure, PromQL and metric names."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvobserve.export.catalog import BY_NAME

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"
CHECK_DIR = DASHBOARDS / "check"
UIDS = {
    "kvobserve-fleet.json": "kvobserve-fleet",
    "kvobserve-streams.json": "kvobserve-streams",
    "kvobserve-scheduler.json": "kvobserve-scheduler",
    "kvobserve-self.json": "kvobserve-self",
    "kvobserve-cache.json": "kvobserve-cache",
}
VARIABLES = ("datasource", "job", "worker_id", "node_rank", "dp_rank")
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range", "__all"}

# Series Prometheus itself adds for every scrape target.
PROMETHEUS_BUILTIN = frozenset({"up", "scrape_duration_seconds"})
PROMQL_WORDS = frozenset(
    {
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "and",
        "or",
        "unless",
        "bool",
        "offset",
    }
    # aggregation operators may be followed by `by (...)` instead of `(`
    | {
        "sum",
        "min",
        "max",
        "avg",
        "count",
        "stddev",
        "stdvar",
        "group",
        "topk",
        "bottomk",
        "quantile",
    }
)


def _ensure_tools() -> None:
    """Install tsc/@grafana/schema (and promtool) through scripts/install-tools.sh when missing."""
    have_npm = (CHECK_DIR / "node_modules" / ".bin" / "tsc").exists() and (
        CHECK_DIR / "node_modules" / "@grafana" / "schema"
    ).is_dir()
    if have_npm and shutil.which("promtool") and shutil.which("node"):
        return
    subprocess.run(["bash", str(ROOT / "scripts" / "install-tools.sh")], check=True, timeout=900)


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DASHBOARDS / name).read_text())
    return data


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # collapsed rows nest their panels


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]


def _variable_queries(dashboard: dict[str, Any]) -> list[str]:
    return [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]


def _metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (identifiers that are not functions, keywords or labels)."""
    no_strings = re.sub(r'"[^"]*"', '""', expr)
    no_matchers = re.sub(r"\{[^}]*\}", "{}", no_strings)
    no_groupings = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", no_matchers
    )
    no_durations = re.sub(r"\[[^\]]*\]", "", no_groupings)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", no_durations):
        word = match.group(0)
        following = no_durations[match.end() :].lstrip()
        if following.startswith("(") or word in PROMQL_WORDS:
            continue  # a function call or a keyword
        names.add(word)
    return names


def _known(metric: str, allowed: frozenset[str]) -> bool:
    return metric in allowed or re.sub(r"_(bucket|sum|count)$", "", metric) in allowed


@pytest.fixture(scope="module")
def schema_check(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    """One tsc run over the four dashboards plus a deliberately broken copy."""
    _ensure_tools()
    broken = copy.deepcopy(_load("kvobserve-fleet.json"))
    panel = next(p for p in broken["panels"] if p["type"] != "row")
    panel["gridpos"] = panel.pop("gridPos")  # a misspelled key the schema must reject
    broken_path = tmp_path_factory.mktemp("dashboards") / "kvobserve-broken-dashboard.json"
    broken_path.write_text(json.dumps(broken))
    files = [str(DASHBOARDS / name) for name in UIDS] + [str(broken_path)]
    return subprocess.run(
        ["node", str(CHECK_DIR / "check.mjs"), *files], capture_output=True, text=True, timeout=300
    )


def test_shipped_dashboards_type_check(schema_check: subprocess.CompletedProcess[str]) -> None:
    output = schema_check.stdout + schema_check.stderr
    errors = [line for line in output.splitlines() if "error TS" in line]
    for name in UIDS:
        stem = name.removesuffix(".json")
        assert not [e for e in errors if f"{stem}.ts" in e], output


def test_schema_check_rejects_unknown_keys(schema_check: subprocess.CompletedProcess[str]) -> None:
    output = schema_check.stdout + schema_check.stderr
    assert schema_check.returncode == 1, output
    assert any(
        "kvobserve-broken-dashboard.ts" in e and '"gridpos"' in e for e in output.splitlines()
    ), output


def test_all_dashboards_present() -> None:
    assert sorted(p.name for p in DASHBOARDS.glob("*.json")) == sorted(UIDS)


@pytest.mark.parametrize("name", sorted(UIDS))
def test_provisionable_as_is(name: str) -> None:
    dashboard = _load(name)
    text = (DASHBOARDS / name).read_text()
    assert dashboard["uid"] == UIDS[name]
    assert "__inputs" not in dashboard and "${DS_" not in text
    assert dashboard["schemaVersion"] >= 39
    assert dashboard.get("id") is None  # an instance-specific id breaks provisioning elsewhere


@pytest.mark.parametrize("name", sorted(UIDS))
def test_panels_ids_targets_and_datasource(name: str) -> None:
    dashboard = _load(name)
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {name}"
    data_panels = [p for p in _panels(dashboard) if p["type"] != "row"]
    assert len(data_panels) >= 8
    for panel in data_panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], f"{panel['title']}: no targets"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target.get("expr", "").strip(), f"{panel['title']}: target without expr"
            assert target["datasource"]["uid"] == "${datasource}"


@pytest.mark.parametrize("name", sorted(UIDS))
def test_grid_has_no_overlaps(name: str) -> None:
    taken: set[tuple[int, int]] = set()
    for panel in _load(name)["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        cells = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & taken, f"{name}: {panel['title']} overlaps another panel"
        taken |= cells


@pytest.mark.parametrize("name", sorted(UIDS))
def test_template_variables(name: str) -> None:
    dashboard = _load(name)
    by_name = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert tuple(by_name) == VARIABLES
    assert by_name["datasource"]["type"] == "datasource"
    assert by_name["datasource"]["query"] == "prometheus"
    for var in VARIABLES[1:]:
        spec = by_name[var]
        assert spec["type"] == "query" and spec["multi"] and spec["includeAll"], var
        assert spec["allValue"] == ".*", var  # regex matchers (=~) need a regex for "All"
        assert re.fullmatch(rf"label_values\(\w+(\{{[^}}]*\}})?, {var}\)", spec["query"]), spec[
            "query"
        ]
        assert spec["datasource"]["uid"] == "${datasource}"
    used = set(re.findall(r"\$(\w+)", json.dumps(_exprs(dashboard) + _variable_queries(dashboard))))
    assert used <= set(VARIABLES) | GRAFANA_BUILTINS, used - set(VARIABLES) - GRAFANA_BUILTINS
    assert {"job", "worker_id", "dp_rank"} <= used


@pytest.mark.parametrize("name", sorted(UIDS))
def test_metric_names_in_catalog(name: str) -> None:
    # Every kvobserve series a dashboard queries is one the exporter serves (export/catalog.py).
    dashboard = _load(name)
    used = [_metric_names(expr) for expr in _exprs(dashboard)]
    used += [
        set(re.findall(r"label_values\((\w+)", query)) for query in _variable_queries(dashboard)
    ]
    assert all(used), "an expression without a metric name"
    for expr, metrics in zip(_exprs(dashboard) + _variable_queries(dashboard), used, strict=True):
        for metric in metrics:
            assert _known(metric, frozenset(BY_NAME)) or metric in PROMETHEUS_BUILTIN, (
                f"{name}: {metric} in {expr} is not in export/catalog.py"
            )


def test_metric_name_extraction() -> None:
    expr = (
        'sum by (le, medium) (rate(kvobserve_kv_block_lifetime_seconds_bucket{job=~"$job", x="a b"}[5m]))'
        " / on (job) group_left (collector) kvobserve_stream_info or vector(0) and up"
    )
    assert _metric_names(expr) == {
        "kvobserve_kv_block_lifetime_seconds_bucket",
        "kvobserve_stream_info",
        "up",
    }


def test_promql_parses(tmp_path: Path) -> None:
    """Every dashboard expression, with variables filled in, parses as PromQL (promtool check rules)."""
    _ensure_tools()
    rules = []
    for name in sorted(UIDS):
        for i, expr in enumerate(_exprs(_load(name))):
            concrete = expr.replace("$__rate_interval", "5m")
            concrete = re.sub(r"\$\w+", ".*", concrete)
            rules.append(
                {
                    "record": f"dashboard:{name.split('.')[0].replace('-', '_')}:{i}",
                    "expr": concrete,
                }
            )
    path = tmp_path / "dashboard-exprs.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboards", "rules": rules}]}))
    proc = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules)} rules found" in proc.stdout


_SELECTOR = re.compile(r"\b(kvobserve_[a-z_]+)\{([^}]*)\}")


def _matched_labels(expr: str) -> Iterator[tuple[str, set[str]]]:
    """(metric, label names its matchers use) for every kvobserve selector in `expr`."""
    for m in _SELECTOR.finditer(expr):
        yield m.group(1), set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", m.group(2)))


@pytest.mark.parametrize("name", sorted(UIDS))
def test_matchers_name_labels_the_family_has(name: str) -> None:
    """A matcher on a label the series lacks matches nothing once a filter is set."""
    for expr in _exprs(_load(name)):
        for metric, labels in _matched_labels(expr):
            family = BY_NAME.get(metric) or BY_NAME.get(re.sub(r"_(bucket|sum|count)$", "", metric))
            if family is None:
                continue  # a pending addition, checked by test_metric_names_in_catalog
            allowed = {*family.labels, "job", "instance", "le"}
            assert labels <= allowed, f"{name}: {metric} has no {labels - allowed} in {expr}"


def test_matched_labels_extraction() -> None:
    expr = 'sum(rate(kvobserve_kv_events_total{job=~"$job", type!="x"}[5m])) / kvobserve_stream_up{a="b"}'
    assert list(_matched_labels(expr)) == [
        ("kvobserve_kv_events_total", {"job", "type"}),
        ("kvobserve_stream_up", {"a"}),
    ]
