"""One table for conditions and alerts: the page, the API, the rule file and the runbook agree."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from kvobserve.analysis.conditions import BY_ALERT, DEFAULT_RUNBOOK_URL, KINDS, SEVERITIES
from kvobserve.analysis.fleet import FleetState
from kvobserve.export import api
from kvobserve.wire.snapshot import CollectorInfo, Snapshot, StreamStats, WorkerInfo

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "alerts" / "kvobserve-rules.yml"
RUNBOOK = ROOT / "docs" / "alerts.md"
CONDITIONS_PY = ROOT / "kvobserve" / "analysis" / "conditions.py"


def _rule_severities() -> dict[str, str]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r["labels"]["severity"] for g in doc["groups"] for r in g["rules"]}


def _sections() -> dict[str, str]:
    """docs/alerts.md: '## Name' -> the section's text."""
    parts = re.split(r"^## (\S+)\s*$", RUNBOOK.read_text(), flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_every_rule_is_in_the_table_with_its_severity() -> None:
    rules = _rule_severities()
    assert set(rules) == set(BY_ALERT), "alerts in the rule file and in analysis/conditions.py"
    for alert, severity in rules.items():
        assert BY_ALERT[alert].severity == severity, alert


def test_every_condition_the_aggregator_yields_has_a_row() -> None:
    """A stream's condition is found by its row's check; the others by Condition.of(kind)."""
    over_membership = set(re.findall(r'Condition\.of\(\s*"(\w+)"', CONDITIONS_PY.read_text()))
    assert over_membership, "no Condition.of calls found"
    assert over_membership <= set(KINDS), over_membership - set(KINDS)
    per_stream = {k.kind for k in KINDS.values() if k.per_stream}
    assert not per_stream & over_membership, per_stream & over_membership
    yielded = over_membership | per_stream
    # ... and every row is yielded somewhere: the page shows what the alerts fire on.
    assert set(KINDS) <= yielded, set(KINDS) - yielded


def test_every_alert_has_a_runbook_section_stating_its_severity_and_condition() -> None:
    sections = _sections()
    for k in KINDS.values():
        assert k.alert in sections, f"docs/alerts.md has no '## {k.alert}' section"
        text = sections[k.alert]
        assert f"**Severity:** {k.severity}." in text, k.alert
        assert f"**Condition:** `{k.kind}`" in text, k.alert
    assert set(sections) - {"Conventions"} == set(BY_ALERT)
    assert all(k.severity in SEVERITIES for k in KINDS.values())


def test_rule_runbook_urls_are_the_default_base_and_anchor() -> None:
    doc = yaml.safe_load(RULES.read_text())
    for r in (r for g in doc["groups"] for r in g["rules"]):
        assert r["annotations"]["runbook_url"] == f"{DEFAULT_RUNBOOK_URL}#{r['alert'].lower()}"


def test_the_api_gives_the_rule_files_severity() -> None:
    """A duplicate stream and an incomplete index: the API says what the rules say."""
    snap = Snapshot(
        CollectorInfo("c", 0, "h", 1.0),
        seq=1,
        time=100.0,
        workers=[WorkerInfo("w", "sglang", 1, [0], True)],
        streams=[
            StreamStats("w", 0, up=True, batches_total=5, duplicate_stream=True,
                        state_complete=False)
        ],
    )  # fmt: skip
    state = FleetState()
    state.update(snap, 100.0)
    alerts = {a["kind"]: a for a in api.alerts_json(state.view(100.5))}
    rules = _rule_severities()
    assert alerts["duplicate_stream"]["severity"] == rules["KVEventDuplicateStream"] == "warning"
    assert alerts["index_incomplete"]["severity"] == rules["KVIndexIncomplete"] == "info"
    assert alerts["duplicate_stream"]["runbook_url"].endswith("alerts.md#kveventduplicatestream")
