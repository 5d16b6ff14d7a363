"""Bind mode in the exports: the metrics of a bound endpoint and its relay, stale rules, the
condition, the API and the status page (the rich fleet's node-1 binds `llmd` with a relay)."""

from __future__ import annotations

import msgspec
from prometheus_client import CollectorRegistry, generate_latest

from kvobserve.analysis.conditions import active
from kvobserve.analysis.fleet import FleetState
from kvobserve.export import api, status_page
from kvobserve.export.prometheus import FleetCollector
from kvobserve.export.scrape import ScrapeCache
from kvobserve.wire.snapshot import Snapshot
from tests.unit.test_export_fleet import NOW, _node1, rich_view
from tests.unit.test_export_scrape import check

BOUND = {"collector": "node-1", "worker_id": "llmd", "dp_rank": "0"}


def _registry(snap: Snapshot, now: float) -> CollectorRegistry:
    state = FleetState()
    state.update(snap, snap.time)
    view = state.view(now)
    r = CollectorRegistry()
    r.register(FleetCollector(lambda: view))
    return r


def test_a_bound_endpoint_and_its_relay_in_metrics() -> None:
    r = _registry(_node1(), NOW)
    value = r.get_sample_value
    assert value("kvobserve_bind_publishers", {**BOUND, "endpoint": "tcp://*:5556"}) == 2
    assert value("kvobserve_bind_messages_total", BOUND) == 500
    assert value("kvobserve_bind_skipped_total", {**BOUND, "reason": "topic_mismatch"}) == 4
    assert value("kvobserve_relay_up", {**BOUND, "target": "tcp://10.0.1.9:5556"}) == 0
    assert value("kvobserve_relay_forwarded_total", BOUND) == 480
    assert value("kvobserve_relay_dropped_total", {**BOUND, "reason": "no_target"}) == 14
    # a reason that has not happened is served from the start: increase() sees its first drop
    assert value("kvobserve_relay_dropped_total", {**BOUND, "reason": "queue_full"}) == 0


def test_a_silent_collector_keeps_its_counters_and_loses_its_gauges() -> None:
    r = _registry(_node1(), NOW + 60)  # 3 intervals and more without a snapshot
    value = r.get_sample_value
    assert value("kvobserve_bind_publishers", {**BOUND, "endpoint": "tcp://*:5556"}) is None
    assert value("kvobserve_relay_up", {**BOUND, "target": "tcp://10.0.1.9:5556"}) is None
    assert value("kvobserve_relay_dropped_total", {**BOUND, "reason": "no_target"}) == 14
    assert value("kvobserve_bind_messages_total", BOUND) == 500


def test_relay_drops_are_a_condition_for_15_minutes() -> None:
    view = rich_view()
    (c,) = [c for c in active(view) if c.kind == "relay_dropping"]
    assert (c.severity, dict(c.labels), c.since) == ("warning", BOUND, NOW - 30)
    assert c.description == (
        "llmd rank 0: frames not forwarded to tcp://10.0.1.9:5556 (no_target 14); relay "
        "connecting: disconnected: tcp://10.0.1.9:5556 went away (restarted?)"
    )
    old = _node1()
    assert old.binds[0].relay is not None
    relay = msgspec.structs.replace(old.binds[0].relay, last_drop_time=NOW - 901)
    snap = msgspec.structs.replace(old, binds=[msgspec.structs.replace(old.binds[0], relay=relay)])
    state = FleetState()
    state.update(snap, NOW - 0.2)
    assert "relay_dropping" not in {c.kind for c in active(state.view(NOW))}


def test_the_api_and_the_page_show_the_endpoint_and_its_relay() -> None:
    view = rich_view()
    fleet = api.fleet_json(view)
    (b,) = fleet["binds"]
    assert (b["worker_id"], b["state"], b["publishers"], b["streams"]) == (
        "llmd",
        "connected",
        2,
        2,
    )
    assert b["relay"]["dropped"] == {"no_target": 14} and b["relay"]["state"] == "connecting"
    page = status_page.render(fleet, api.streams_json(view), api.alerts_json(view),
                              generated=NOW, refresh_s=5)  # fmt: skip
    section = page.split("<h2>Bound endpoints</h2>", 1)[1].split("<h2>", 1)[0]
    assert 'class="c-warning"' in section  # a relay that dropped frames stands out
    for text in ("tcp://*:5556", "kv@{pod}@{model}", "topic_mismatch 4", "dropped no_target 14",
                 "disconnected: tcp://10.0.1.9:5556 went away (restarted?)"):  # fmt: skip
        assert text in section, text
    # a fleet without bind mode has no such section
    plain = {**fleet, "binds": []}
    assert "Bound endpoints" not in status_page.render(plain, [], [], generated=NOW, refresh_s=5)


def test_a_bound_endpoint_without_a_relay_beside_one_with_a_relay() -> None:
    """Bind mode without `relay_to` (docs/deployment.md "Engines that connect"): its endpoints
    serve their own series and no relay series, beside one that relays, in both writers (a
    scrape of main answered 500: the relay's target was read off every bound endpoint)."""
    snap = _node1()
    plain = msgspec.structs.replace(snap.binds[0], worker_id="vllm", relay=None, publishers=1)
    snap = msgspec.structs.replace(snap, binds=[plain, snap.binds[0]])
    r = _registry(snap, NOW)
    value = r.get_sample_value
    mine = {**BOUND, "worker_id": "vllm"}
    assert value("kvobserve_bind_publishers", {**mine, "endpoint": "tcp://*:5556"}) == 1
    assert value("kvobserve_bind_messages_total", mine) == 500
    assert value("kvobserve_relay_forwarded_total", mine) is None
    assert value("kvobserve_relay_forwarded_total", BOUND) == 480
    assert value("kvobserve_relay_up", {**BOUND, "target": "tcp://10.0.1.9:5556"}) == 0
    body = generate_latest(r).decode()
    assert body.count("kvobserve_relay_up{") == 1
    assert body.count('kvobserve_relay_dropped_total{collector="node-1",dp_rank="0",reason=') == 2
    state = FleetState()
    state.update(snap, snap.time)
    for om in (False, True):
        check(ScrapeCache(), state.view(NOW), om)  # the cached text: the same bytes
