"""One table for conditions and alerts: the page, the API, the rule file and the runbook agree."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from kvobserve.analysis.conditions import (
    BY_ALERT,
    DEFAULT_RUNBOOK_URL,
    FOLLOWS,
    KINDS,
    SEVERITIES,
    Condition,
    grouped,
    labels,
)
from kvobserve.analysis.fleet import FleetState
from kvobserve.export import api
from kvobserve.wire.snapshot import CollectorInfo, Snapshot, StreamStats, WorkerInfo

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "alerts" / "kvobserve-rules.yml"
RUNBOOK = ROOT / "docs" / "alerts.md"
ALERTMANAGER = ROOT / "alerts" / "alertmanager.yml"


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


def test_every_row_says_what_finds_it() -> None:
    """A row is found over the fleet by its finder, or stream by stream (an event's time and
    description, or a check and its pre-check): exactly one of them. No other code makes a
    condition: the kind is always the row's (no lookup of a kind by its name)."""
    for k in KINDS.values():
        ways = [k.finds is not None, bool(k.event_time), k.check is not None]
        assert sum(ways) == 1, k.kind
        assert k.per_stream == (k.finds is None), k.kind
    code = "\n".join(p.read_text() for p in (ROOT / "kvobserve").rglob("*.py"))
    assert "Condition.of(" not in code
    made = re.findall(r"\bCondition\(\s*(\S+?),", code)  # outside the table's two loops: none
    assert made == ["k.kind", "k.kind"], made


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
                        state_complete=False, vouched=False, vouched_since=-600.0)
        ],
    )  # fmt: skip
    state = FleetState()
    state.update(snap, 100.0)
    alerts = {a["kind"]: a for a in api.every_alert(api.alerts_json(state.view(100.5)))}
    rules = _rule_severities()
    assert alerts["duplicate_stream"]["severity"] == rules["KVEventDuplicateStream"] == "warning"
    assert alerts["index_incomplete"]["severity"] == rules["KVIndexIncomplete"] == "warning"
    assert alerts["duplicate_stream"]["runbook_url"].endswith("alerts.md#kveventduplicatestream")
    # the index is incomplete because of the second publisher: under it, one entry
    (top,) = api.alerts_json(state.view(100.5))
    assert [c["kind"] for c in top["consequences"]] == ["index_incomplete"]


def test_the_inhibition_rules_are_what_follows_from_a_cause() -> None:
    """alerts/alertmanager.yml mutes an alert under another exactly where the page, `status`
    and /api/v1/alerts list its condition under the other's (FOLLOWS): one relation."""
    rules = yaml.safe_load(ALERTMANAGER.read_text())["inhibit_rules"]
    shipped = []
    for r in rules:
        ((source,), (target,)) = (r["source_matchers"], r["target_matchers"])
        names = [re.fullmatch(r'alertname="(\w+)"', m) for m in (source, target)]
        assert all(names), r  # every rule is by alert name, and only by it
        shipped.append((names[0].group(1), names[1].group(1), tuple(r["equal"])))  # type: ignore[union-attr]
    declared = [
        (KINDS[f.cause].alert, KINDS[f.then].alert, ("job", "instance", *f.on)) for f in FOLLOWS
    ]
    assert shipped == declared


def test_a_lost_collector_is_one_cause_with_its_streams_and_ranks_under_it() -> None:
    """The grouping reads FOLLOWS as Alertmanager reads the rules: the labels in `on` equal (a
    label one side lacks is empty), so nothing of another collector goes under it."""

    def c(kind: str, **kw: object) -> Condition:
        return Condition(kind, KINDS[kind].severity, labels(**kw), kind)

    lost = c("collector_down", collector="node-1", node_rank=1)
    mine = [c("stream_down", worker_id="w", node_rank=1, dp_rank=r, collector="node-1")
            for r in (4, 5)]  # fmt: skip
    ranks = [c("dp_rank_uncovered", worker_id="w", dp_rank=r, node_rank=1, collector="node-1")
             for r in (4, 5)]  # fmt: skip
    other = c("stream_down", worker_id="w", node_rank=0, dp_rank=2, collector="node-0")
    never = c("dp_rank_uncovered", worker_id="v", dp_rank=1)  # no collector ever owned it
    gap = c("sequence_gap", worker_id="w", node_rank=0, dp_rank=1, collector="node-0")
    loss = c("events_lost", worker_id="w", node_rank=0, dp_rank=1, collector="node-0")
    got = grouped([lost, ranks[0], ranks[1], never, mine[0], other, mine[1], gap, loss])
    assert [(k, then) for k, then in got] == [
        (lost, [ranks[0], ranks[1], mine[0], mine[1]]),
        (never, []),
        (other, []),
        (loss, [gap]),  # the cause first, wherever it came in the list
    ]
