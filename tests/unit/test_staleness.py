"""The staleness rule (docs/metrics.md): a dead source's gauges leave /metrics, the API and the
conditions; counters and health stay. Checked family by family against the catalog's `stale`
flag, for a stream that is down, a collector that is gone and a rank whose scheduler values
stopped arriving, on every /metrics writer.

The fleet is issue 21's "dead engine keeps its last values": rank 1's engine was killed while its
collector runs on; its last snapshot values (1122 blocks, 99.95% cache usage, 31 running
requests, 99% token usage) must not be served as if measured now.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvobserve.analysis.conditions import active
from kvobserve.analysis.fleet import FleetState
from kvobserve.commands import status as statuscmd
from kvobserve.export import status_page
from kvobserve.export.api import alerts_json, fleet_json, streams_json
from kvobserve.export.catalog import BY_NAME, CATALOG, STREAM
from kvobserve.export.prometheus import FleetCollector
from kvobserve.export.scrape import ScrapeCache
from kvobserve.export.series import Detail
from kvobserve.wire.snapshot import (
    CollectorInfo,
    DriftStats,
    MediumStats,
    SchedulerStats,
    Snapshot,
    StreamStats,
    WorkerInfo,
)
from tests.unit.test_export_scrape import check

NOW = 8000.0
W = "sglang-dp8"
CAP = 18000
DEAD_REASON = "disconnected: the publisher went away (engine stopped?)"


def _stream(rank: int, **kw: object) -> StreamStats:
    base: dict[str, object] = dict(
        engine="sglang", endpoint=f"tcp://127.0.0.1:{5557 + rank}", topic="kv-events", up=True,
        state="up", reason="receiving", batches_total=300, events={"stored": 300},
        media=[MediumStats("GPU", 1122, 17952, 1500, 378)], gaps=1, missed=1, recovered=1,
        state_complete=True, trust="complete", last_batch_ts=NOW - 1, lag_seconds=0.01,
        silent_loss={"remove_unknown": 1}, interleaved_batches=2,
        replay_requests={"ok": 1}, decode_errors={"msgpack": 1},
    )  # fmt: skip
    base.update(kw)
    return StreamStats(W, rank, **base)  # type: ignore[arg-type]


def _sched(rank: int, updated: float, source: str = "load") -> SchedulerStats:
    return SchedulerStats(W, rank, source, 31, 2, 0.99, 0.5, CAP, updated=updated)


# Its engine was killed 60 s ago; these are the collector's last values of it.
DEAD = _stream(
    1, up=False, state="connecting", reason=DEAD_REASON, state_since=NOW - 60,
    last_batch_ts=NOW - 60, duplicate_stream=True, media=[MediumStats("GPU", 1125, 18000, 1500, 375)],
)  # fmt: skip


def _state() -> FleetState:
    """node-0 watches ranks 0-2: 0 is up, 1's engine was killed 60 s ago, 2's load PUB went
    quiet 10 s ago (its KV stream is up); node-1 (rank 3) has been silent for 10 s."""
    node0 = Snapshot(
        CollectorInfo("node-0", 0, "gpu-0", 1000.0),
        seq=60,
        time=NOW - 0.5,
        interval_s=1.0,
        workers=[WorkerInfo(W, "sglang", 4, [0, 1, 2], True, CAP)],
        streams=[_stream(0, duplicate_stream=True), DEAD, _stream(2)],
        scheduler=[_sched(0, NOW - 1), _sched(1, NOW - 1), _sched(2, NOW - 10)],
        drift=[
            DriftStats(W, 0, "GPU", "dump", 100, 1122, 60, 40, 0, 0.5, True, NOW - 1),
            DriftStats(W, 1, "GPU", "dump", 100, 1122, 60, 40, 0, 0.5, True, NOW - 1),
        ],
    )
    node1 = Snapshot(
        CollectorInfo("node-1", 1, "gpu-1", 1000.0),
        seq=9,
        time=NOW - 10,
        interval_s=1.0,
        workers=[WorkerInfo(W, "sglang", 4, [3], False, CAP)],
        streams=[_stream(3)],
        scheduler=[_sched(3, NOW - 10.5)],
    )
    fs = FleetState()
    fs.update(node1, NOW - 10)
    fs.update(node0, NOW - 0.5)
    return fs


def _samples(body: bytes) -> dict[str, set[int]]:
    """Family name -> the dp_ranks it has a sample for (sample names folded to the family)."""
    out: dict[str, set[int]] = {}
    for fam in text_string_to_metric_families(body.decode()):
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        for s in fam.samples:
            if "dp_rank" in s.labels:
                out.setdefault(name, set()).add(int(s.labels["dp_rank"]))
    return out


def _scrape(detail: Detail) -> bytes:
    state = _state()
    reg = CollectorRegistry(auto_describe=False)
    reg.register(
        FleetCollector(
            lambda: state.view(NOW),
            per_stream_detail=detail.per_stream_detail,
        )
    )
    return generate_latest(reg)


# a rank's scheduler values (not the per-source families: errors, states)
SCHEDULER_FAMILIES = {
    m.name for m in CATALOG if m.name.startswith("kvobserve_scheduler_") and m.labels == STREAM
}
# Per-stream families the fleet above serves for its live rank 0: the check is not vacuous.
MUST_COVER = {
    "kvobserve_kv_blocks", "kvobserve_kv_tokens", "kvobserve_kv_capacity_tokens",
    "kvobserve_kv_cache_usage_ratio", "kvobserve_kv_duplicate_stream",
    "kvobserve_kv_state_complete", "kvobserve_kv_last_batch_timestamp_seconds",
    "kvobserve_kv_event_lag_seconds", "kvobserve_stream_up", "kvobserve_stream_info",
    "kvobserve_kv_event_batches_total", "kvobserve_kv_blocks_stored_total",
    "kvobserve_kv_silent_loss_evidence_total", "kvobserve_router_index_phantom_blocks",
    "kvobserve_scheduler_running_requests", "kvobserve_scheduler_token_usage_ratio",
}  # fmt: skip


def test_every_per_stream_family_follows_its_catalog_rule() -> None:
    """Rank 0 (up) has every family; rank 1 (stream down) and rank 3 (collector gone) exactly
    the families the catalog keeps; rank 2 (stream up, scheduler values stale) its stream's
    families but no scheduler gauge."""
    got = _samples(_scrape(Detail(per_stream_detail=True)))
    per_stream = [
        m for m in CATALOG if (m.stale is not None and m.labels[:3] == STREAM) or m.detail
    ]
    covered = {m.name for m in per_stream if 0 in got.get(m.name, set())}
    assert covered >= MUST_COVER, MUST_COVER - covered
    for m in per_stream:
        if m.name not in covered:
            continue
        ranks = got[m.name]
        for dead in (1, 3):
            assert (dead in ranks) is bool(m.stale), (m.name, dead, m.stale)
        if m.name in SCHEDULER_FAMILIES:
            assert 2 not in ranks, (m.name, "stale scheduler values served")
        elif not m.name.startswith("kvobserve_router_index_"):  # rank 2 has no drift source
            assert 2 in ranks, m.name  # rank 2's stream is up: its own gauges stay


def test_worker_sums_count_down_ranks_as_unknown() -> None:
    """Issue 30: a dead rank left the trust sum, so a worker with ranks down looked whole."""
    text = _scrape(Detail()).decode()
    trust = [ln for ln in text.splitlines() if ln.startswith("kvobserve_kv_view_trust_ranks{")]
    assert trust == [
        f'kvobserve_kv_view_trust_ranks{{trust="complete",worker_id="{W}"}} 2.0',
        f'kvobserve_kv_view_trust_ranks{{trust="unknown",worker_id="{W}"}} 2.0',  # ranks 1, 3
    ]
    # rank 1 held more than its capacity at its last word: not claimed now
    assert 'kvobserve_kv_resident_over_capacity{dp_rank="1"' not in text


@pytest.mark.parametrize("detail", [Detail(), Detail(per_stream_detail=True)])
def test_every_writer_serves_the_same_bytes(detail: Detail) -> None:
    view = _state().view(NOW)
    cache = ScrapeCache(detail)
    for om in (False, True, False):  # the third render comes from the cache
        body = check(cache, view, om)
    assert b'kvobserve_kv_blocks{dp_rank="1"' not in body
    assert b'kvobserve_kv_last_batch_timestamp_seconds{dp_rank="1"' in body


def test_api_shows_a_dead_ranks_gauges_as_unknown_and_keeps_its_health() -> None:
    view = _state().view(NOW)
    by_rank = {s["dp_rank"]: s for s in streams_json(view)}
    dead = by_rank[1]
    assert (dead["up"], dead["live"], dead["state"], dead["reason"]) == (
        False, True, "connecting", DEAD_REASON,
    )  # fmt: skip
    for key in ("cache_usage_ratio", "token_usage_ratio", "capacity_tokens", "state_complete",
                "duplicate_stream", "trust", "lag_seconds", "over_capacity",
                "scheduler_source"):  # fmt: skip
        assert dead[key] is None, key
    assert dead["blocks"] == {} and dead["tokens"] == {}
    assert (dead["batches"], dead["gaps"], dead["last_batch_ts"]) == (300, 1, NOW - 60)
    assert by_rank[0]["cache_usage_ratio"] == pytest.approx(17952 / CAP)
    assert by_rank[0]["token_usage_ratio"] == 0.99
    # rank 2: its stream is up (cache usage known), its scheduler values are 10 s old
    assert by_rank[2]["cache_usage_ratio"] is not None and by_rank[2]["token_usage_ratio"] is None
    assert by_rank[2]["scheduler_source"] == "load"  # who reports it, though not lately
    assert by_rank[3]["state"] == "stale" and by_rank[3]["cache_usage_ratio"] is None


def _kinds(conditions: Iterable[object]) -> set[tuple[str, str]]:
    return {(c.kind, dict(c.labels).get("dp_rank", "")) for c in conditions}  # type: ignore[attr-defined]


def test_no_condition_on_a_dead_ranks_last_values() -> None:
    """cache_near_full, duplicate_stream and router_index_drift only for rank 0; rank 1 is
    stream_down. The per-second check (FleetState.conditions) agrees with the view's."""
    state = _state()
    for found in (_kinds(active(state.view(NOW))), _kinds(state.conditions(NOW))):
        for kind in ("cache_near_full", "duplicate_stream", "router_index_drift"):
            assert {r for k, r in found if k == kind} == {"0"}, (kind, found)
        assert ("stream_down", "1") in found and ("stream_down", "3") in found


def test_page_and_cli_show_no_usage_for_the_dead_rank() -> None:
    view = _state().view(NOW)
    streams, alerts = streams_json(view), alerts_json(view)
    html = status_page.render(fleet_json(view), streams, alerts, generated=NOW, refresh_s=5)
    assert "<th>cache usage</th><th>token usage</th>" in html
    row = html.split('<tr data-rank="1" data-state="connecting">')[1].split("</tr>")[0]
    assert f"<td>{DEAD_REASON}<br>" in row
    # cache usage, then token usage: unknown, not 100%, and no scheduler source claimed for it
    assert '<td class=n>-</td><td class="n">-</td>' in row
    live = html.split('<tr data-rank="0" data-state="up">')[1].split("</tr>")[0]
    assert '<td class=n>100%</td><td class="n c-warning">99%<br>' in live  # cache_near_full
    text = statuscmd.render(streams, alerts)
    head, *rows = text.splitlines()
    cols = head.split()
    assert cols[12:15] == ["USAGE", "TOKEN_USAGE", "REASON"]
    dead = next(r.split() for r in rows if r.split()[:2] == [W, "1"])
    assert dead[4] == "connecting" and dead[12:14] == ["-", "-"], dead
    live = next(r.split() for r in rows if r.split()[:2] == [W, "0"])
    assert live[12:14] == ["100%", "99%"], live


@pytest.mark.parametrize(
    ("source", "interval", "age", "served"),
    [
        ("load", 1.0, 2.9, True),
        ("load", 1.0, 3.1, False),
        ("load+metrics", 1.0, 5.9, True),  # a /metrics scrape may take its 2 s timeout
        ("metrics", 1.0, 6.1, False),
        ("kv_metrics", 1.0, 29.0, True),  # Dynamo's ActiveLoad repeats every 10 s
        ("kv_metrics", 1.0, 31.0, False),
        ("load", 5.0, 14.0, True),  # a longer collector interval wins
        ("load", 1.0, None, True),  # `updated` 0: an older collector, not judged
    ],
)
def test_scheduler_values_age_against_their_collector_and_source(
    source: str, interval: float, age: float | None, served: bool
) -> None:
    updated = 0.0 if age is None else NOW - 1 - age
    snap = Snapshot(
        CollectorInfo("node-0"), seq=1, time=NOW - 1, interval_s=interval,
        workers=[WorkerInfo(W, "sglang", 1, [0], True)], streams=[_stream(0)],
        scheduler=[SchedulerStats(W, 0, source, 31, 0, 0.5, None, CAP, updated=updated)],
    )  # fmt: skip
    fs = FleetState()
    fs.update(snap, NOW - 1)
    v = fs.view(NOW)
    assert bool(v.scheduler) is served
    # the capacity it reported stays: a constant of the engine, for cache usage
    assert v.streams[0].capacity_tokens == CAP


def test_the_catalog_says_it_per_family() -> None:
    assert BY_NAME["kvobserve_kv_last_batch_timestamp_seconds"].while_down == "kept"
    assert BY_NAME["kvobserve_kv_cache_usage_ratio"].while_down == "absent, also while unvouched"
    assert BY_NAME["kvobserve_kv_blocks"].while_down == "absent, also while unvouched"
    assert BY_NAME["kvobserve_kv_event_batches_total"].while_down == "kept"
    for name in SCHEDULER_FAMILIES:
        assert BY_NAME[name].while_down == "absent, also when stale", name
