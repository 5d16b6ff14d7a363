"""Alert rules, their promtool tests, the Alertmanager example and the runbook agree with the contract."""

from __future__ import annotations

import http.server
import json
import re
import shutil
import subprocess
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvobserve import __version__
from kvobserve.export.catalog import BY_NAME
from kvobserve.simulate.ports import free_port
from tests.design_contract import DESIGN_ALERTS, DESIGN_METRICS
from tests.polling import until

NOT_UP = (OSError, ValueError, LookupError)  # Prometheus not up, or no data yet

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "alerts" / "kvobserve-rules.yml"
TESTS_DIR = ROOT / "alerts" / "tests"
ALERTMANAGER = ROOT / "alerts" / "alertmanager.yml"
RUNBOOK = ROOT / "docs" / "alerts.md"
RUNBOOK_BASE = f"https://github.com/kvobserve/kvobserve/blob/v{__version__}/docs/alerts.md"


PAGING = {"KVEventsLost", "DPRankUncovered", "KVObserveCollectorDown", "KVEventStreamDown"}


def _ensure_tools() -> None:
    """Install promtool/amtool through scripts/install-tools.sh when they are missing."""
    if shutil.which("promtool") and shutil.which("amtool"):
        return
    subprocess.run(["bash", str(ROOT / "scripts" / "install-tools.sh")], check=True, timeout=900)
    assert shutil.which("promtool") and shutil.which("amtool"), (
        "install-tools.sh did not provide promtool/amtool"
    )


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    _ensure_tools()
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)


def _rules() -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    rules: dict[str, dict[str, Any]] = {}
    for group in doc["groups"]:
        for rule in group["rules"]:
            assert "alert" in rule, f"recording rule in the alerts file: {rule}"
            assert rule["alert"] not in rules, f"duplicate alert {rule['alert']}"
            rules[rule["alert"]] = rule
    return rules


def _test_files() -> list[Path]:
    files = sorted(TESTS_DIR.glob("*.yml"))
    assert files, "no promtool test files in alerts/tests"
    return files


def _alert_cases() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    for path in _test_files():
        for test in yaml.safe_load(path.read_text())["tests"]:
            cases.extend(test.get("alert_rule_test", []))
    return cases


def test_promtool_check_rules() -> None:
    proc = _run("promtool", "check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in proc.stdout


def test_promtool_unit_tests_pass() -> None:
    proc = _run("promtool", "test", "rules", *map(str, _test_files()))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAILED" not in proc.stdout


def test_amtool_check_config() -> None:
    proc = _run("amtool", "check-config", str(ALERTMANAGER))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


@pytest.mark.parametrize(
    ("severity", "receiver"), [("critical", "pager"), ("warning", "chat"), ("info", "null")]
)
def test_alertmanager_routes_by_severity(severity: str, receiver: str) -> None:
    proc = _run(
        "amtool",
        "config",
        "routes",
        "test",
        f"--config.file={ALERTMANAGER}",
        f"--verify.receivers={receiver}",
        f"severity={severity}",
        "alertname=KVEventsLost",
        "worker_id=w",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == receiver


def test_every_design_alert_has_its_rule() -> None:
    """The names the design fixes are kept (a rename breaks routes and silences); a new alert is
    a row of analysis/conditions.py and its rule, held together by tests/unit/test_alert_table.py."""
    assert set(DESIGN_ALERTS) <= set(_rules()), set(DESIGN_ALERTS) - set(_rules())


@pytest.mark.parametrize("name", sorted(_rules()))
def test_rule_has_required_fields(name: str) -> None:
    rule = _rules()[name]
    assert rule["labels"]["severity"] in {"critical", "warning", "info"}
    annotations = rule["annotations"]
    for key in ("summary", "description", "runbook_url"):
        assert annotations.get(key, "").strip(), f"{name}: empty {key}"
    assert annotations["runbook_url"] == f"{RUNBOOK_BASE}#{name.lower()}"
    # The description names the affected thing through label templates.
    assert "{{ $labels." in annotations["description"], f"{name}: description without labels"
    # Job-agnostic: no rule selects on the scrape job.
    assert not re.search(r"\bjob\s*=", rule["expr"]), f"{name}: selects on job"


def test_severity_policy() -> None:
    rules = _rules()
    severities = {name: rule["labels"]["severity"] for name, rule in rules.items()}
    for name in PAGING:
        assert severities[name] == "critical", name
    # information, not warnings: a gap that replay recovered, an engine restart, a router that
    # does not route by prefix (issue 30, "Quiet when healthy")
    for name in ("KVEventSequenceGap", "KVEventPublisherRestarted", "KVCachePlacementMisses"):
        assert severities[name] == "info", name


def test_rules_use_only_catalog_metrics() -> None:
    for name, rule in _rules().items():
        for metric in set(re.findall(r"\bkvobserve_[a-z0-9_]+", rule["expr"])):
            base = re.sub(r"_(bucket|sum|count)$", "", metric)
            # the design's catalog, or (the cache-analytics alerts) the code's: docs/metrics.md
            known = DESIGN_METRICS | set(BY_NAME)
            assert metric in known or base in known, f"{name}: unknown {metric}"


def test_every_alert_has_firing_and_silent_case() -> None:
    rules = _rules()
    firing: dict[str, list[dict[str, Any]]] = {name: [] for name in rules}
    silent: dict[str, int] = dict.fromkeys(rules, 0)
    for case in _alert_cases():
        name = case["alertname"]
        assert name in rules, f"test for unknown alert {name}"
        expected = case.get("exp_alerts") or []
        if expected:
            firing[name].extend(expected)
        else:
            silent[name] += 1
    for name in rules:
        assert firing[name], f"{name}: no case where it fires"
        assert silent[name], f"{name}: no case where it does not fire"
        for alert in firing[name]:
            # Firing cases pin the severity and every annotation exactly.
            assert alert["exp_labels"]["severity"] == rules[name]["labels"]["severity"], name
            assert set(alert["exp_annotations"]) == {"summary", "description", "runbook_url"}, name


def test_inhibition_labels_exist_on_both_alerts() -> None:
    """Each inhibit rule's `equal` labels are carried by its source and target alerts (per the tests)."""
    labels_of: dict[str, set[str]] = {}
    for case in _alert_cases():
        for alert in case.get("exp_alerts") or []:
            labels_of.setdefault(case["alertname"], set()).update(alert["exp_labels"])
    config = yaml.safe_load(ALERTMANAGER.read_text())
    assert config["inhibit_rules"]
    for rule in config["inhibit_rules"]:
        names = []
        for matcher in [*rule["source_matchers"], *rule["target_matchers"]]:
            found = re.fullmatch(r'alertname="(\w+)"', matcher)
            assert found, f"inhibit rules name exact alerts: {matcher}"
            names.append(found.group(1))
        for name in names:
            assert name in _rules()
            missing = set(rule["equal"]) - labels_of[name]
            assert not missing, f"{name} lacks {missing} used by an inhibit rule"


def test_runbook_has_a_section_per_alert() -> None:
    headings = re.findall(r"^## (\S+)\s*$", RUNBOOK.read_text(), flags=re.MULTILINE)
    for name in _rules():
        # GitHub anchors are the lowercased heading text, which is what runbook_url points at.
        assert name in headings, f"docs/alerts.md has no '## {name}' section"


# --- a real Prometheus scraping the golden /metrics file, with the rules loaded -----------------

GOLDEN = ROOT / "tests" / "fixtures" / "golden" / "metrics.txt"
DASHBOARDS = ROOT / "dashboards"


class _GoldenHandler(http.server.BaseHTTPRequestHandler):
    """Serves the golden scrape of a fixed fleet as /metrics."""

    body = b""

    def do_GET(self) -> None:
        """Answer every GET with the golden exposition."""
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: Any) -> None:
        """Keep test output quiet."""


def _get(base: str, path: str, **params: str) -> Any:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}" if params else f"{base}{path}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prometheus on 127.0.0.1 that scrapes the golden file every second and runs our rules."""
    _ensure_tools()
    # The golden file masks clock-dependent values; any number will do for these checks.
    _GoldenHandler.body = GOLDEN.read_bytes().replace(b"MASKED", b"1")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _GoldenHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    work = tmp_path_factory.mktemp("prometheus")
    (work / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{RULES}']\n"
        "scrape_configs:\n"
        "  - job_name: kvobserve\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{server.server_address[1]}']}}]\n"
    )
    port = free_port()  # Prometheus cannot report the port it bound: one of this worker's block
    base = f"http://127.0.0.1:{port}"
    with (work / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    try:
        # Two scrapes, so rate()/increase() have samples to work on. Prometheus applies the scrape
        # targets about 5 s after start, hence the generous deadline.
        query = "count_over_time(kvobserve_build_info[1m])"
        until(
            lambda: float(_query(base, query)[0]["value"][1]) >= 2,
            30.0,
            "two scrapes",
            retry_on=NOT_UP,
        )
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        server.shutdown()
        server.server_close()


def _query(base: str, query: str) -> list[dict[str, Any]]:
    reply = _get(base, "/api/v1/query", query=query)
    assert reply["status"] == "success", f"{query}: {reply}"
    result: list[dict[str, Any]] = reply["data"]["result"]
    return result


def test_rules_evaluate_without_errors(prometheus: str) -> None:
    def evaluated() -> bool:
        groups = _get(prometheus, "/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return len(rules) == len(_rules()) and all(r["evaluationTime"] > 0 for r in rules)

    until(evaluated, 30.0, "every rule evaluated", retry_on=NOT_UP)
    groups = _get(prometheus, "/api/v1/rules")["data"]["groups"]
    for rule in (r for g in groups for r in g["rules"]):
        assert rule["health"] == "ok", f"{rule['name']}: {rule.get('lastError')}"


def test_golden_fleet_raises_the_expected_alerts(prometheus: str) -> None:
    """The golden fleet has down streams, an uncovered and a doubly owned rank, an extra port."""

    def alerts() -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = _get(prometheus, "/api/v1/alerts")["data"]["alerts"]
        return found

    def keys() -> set[tuple[str, str, str]]:
        return {
            (
                a["labels"]["alertname"],
                a["labels"].get("worker_id", ""),
                a["labels"].get("dp_rank", ""),
            )
            for a in alerts()
        }

    expected = {
        ("KVEventStreamDown", "vllm-b", "1"),
        ("DPRankUncovered", "sglang-a", "3"),
        ("DPRankMultipleOwners", "sglang-a", "1"),
        ("KVEventUnexpectedStream", "sglang-a", "4"),
        # Connected, busy per the scheduler, and no batch in the window (the counters are static).
        ("KVEventStreamStalled", "sglang-a", "0"),
        # node-1 cannot discover sglang-c; node-0's metrics scrape of sglang-a fails (pending)
        ("KVWorkerUndiscovered", "sglang-c", ""),
        ("KVSchedulerSourceDown", "sglang-a", ""),
    }
    # Rules evaluate every second; wait until an evaluation has seen two scrapes.
    until(lambda: expected <= keys(), 30.0, "the expected alerts", retry_on=NOT_UP)
    got = keys()
    down = next(
        a["labels"]
        for a in alerts()
        if (a["labels"]["alertname"], a["labels"].get("worker_id"), a["labels"].get("dp_rank"))
        == ("KVEventStreamDown", "vllm-b", "1")
    )
    # The stream_info join adds what the inhibition and the description need.
    assert down["collector"] == "node-0" and down["endpoint"] == "tcp://10.0.0.6:5558"
    assert down["job"] == "kvobserve" and down["severity"] == "critical"
    # ... and the last owner's join of the uncovered rank: node-2, the down collector
    uncovered = next(
        a["labels"]
        for a in alerts()
        if (a["labels"]["alertname"], a["labels"].get("dp_rank")) == ("DPRankUncovered", "3")
    )
    assert (uncovered["collector"], uncovered["node_rank"]) == ("node-2", "2")
    # Healthy ranks stay quiet.
    assert ("DPRankUncovered", "sglang-a", "0") not in got
    assert ("KVEventStreamDown", "sglang-a", "0") not in got
    # The scheduler says sglang-a dp_rank 1 is idle: no stall alert for it.
    assert ("KVEventStreamStalled", "sglang-a", "1") not in got
    # The down collector's layout mismatch and silent source are not served: no alert on them.
    assert ("KVWorkerLayoutMismatch", "sglang-a", "") not in got
    sources = {a["labels"].get("source") for a in alerts() if "source" in a["labels"]}
    assert sources == {"metrics"}, sources


def test_dashboard_queries_return_data(prometheus: str) -> None:
    """Every dashboard expression runs; those over metrics in the golden scrape return series."""
    golden_names = set(re.findall(r"^(\w+)", GOLDEN.read_text(), flags=re.MULTILINE))
    empty = []
    checked = 0
    for path in sorted(DASHBOARDS.glob("*.json")):
        dashboard = json.loads(path.read_text())
        panels = [q for p in dashboard["panels"] for q in [p, *p.get("panels", [])]]
        for expr in (t["expr"] for p in panels for t in p.get("targets", [])):
            query = re.sub(r"\$\w+", ".*", expr.replace("$__rate_interval", "1m"))
            result = _query(prometheus, query)
            metrics = set(re.findall(r"\bkvobserve_\w+", expr))
            if metrics and metrics <= golden_names:
                checked += 1
                if not result:
                    empty.append(f"{path.name}: {expr}")
    assert not empty, "queries without data on the golden fleet:\n" + "\n".join(empty)
    assert checked >= 60, checked  # nearly every panel is covered by the golden fleet
