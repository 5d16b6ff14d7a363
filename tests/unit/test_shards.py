"""Sharding: snapshot parts per worker bucket, merged again per collector; subjects; settings."""

from __future__ import annotations

import hashlib
import re

import msgspec
import pytest

from kvobserve.analysis.conditions import active
from kvobserve.analysis.fleet import FleetState
from kvobserve.config import MAX_SHARDS, ConfigError, load_config
from kvobserve.transport.subjects import (
    kv_filters,
    kv_key,
    shard_buckets,
    snapshot_subject,
    snapshot_wildcards,
)
from kvobserve.wire.parts import merge_parts, split_parts, worker_bucket
from kvobserve.wire.snapshot import (
    BUCKETS,
    WHOLE,
    CollectorCounters,
    CollectorInfo,
    DriftSource,
    DriftStats,
    DynamoPlaneStats,
    DynamoStreamStats,
    Family,
    Sample,
    SchedulerStats,
    Snapshot,
    SourceErrors,
    StreamStats,
    WorkerInfo,
    decode_snapshot,
    encode_snapshot,
)
from tests.unit.test_export_fleet import NOW, rich_state

WORKERS = ("sglang-a", "vllm-b", "w2")  # buckets 35, 5 and 18


def snapshot(seq: int = 1, start: float = 100.0, workers: tuple[str, ...] = WORKERS) -> Snapshot:
    return Snapshot(
        CollectorInfo("node-0", 0, "h", start),
        seq=seq,
        time=NOW,
        workers=[WorkerInfo(w, "sglang", 2, [0, 1], True) for w in workers],
        streams=[StreamStats(w, r, up=True, batches_total=seq, state_complete=True)
                 for w in workers for r in (0, 1)],
        scheduler=[SchedulerStats(w, 0, "metrics", 1.0) for w in workers],
        scheduler_errors=[SourceErrors(w, "metrics", "http", 1) for w in workers],
        passthrough=[Family("engine_x", "gauge", "", [Sample("engine_x", {"worker_id": w}, 1.0)])
                     for w in workers],
        dynamo=[DynamoStreamStats(w, 0, dynamo_worker_id=5) for w in workers],
        drift=[DriftStats(w, 0, "GPU", router_blocks=3) for w in workers],
        dynamo_planes=[DynamoPlaneStats("plane", "nats")],  # the collector's: in every part
        drift_sources=[DriftSource("plane", "http://indexer")],
        counters=CollectorCounters(messages_received=7),
    )  # fmt: skip


def test_a_workers_bucket_is_fixed_by_its_id() -> None:
    # The wire contract: BLAKE2b-64 of the UTF-8 id, big-endian, modulo 64, everywhere.
    assert [worker_bucket(w) for w in WORKERS] == [35, 5, 18]
    digest = hashlib.blake2b("é".encode(), digest_size=8).digest()
    assert worker_bucket("é") == int.from_bytes(digest, "big") % BUCKETS


def test_parts_hold_one_bucket_each_and_merge_back() -> None:
    snap = snapshot()
    parts = split_parts(snap)
    assert [p.bucket for p in parts] == [5, 18, 35]
    for p in parts:
        assert p.buckets == [5, 18, 35]
        assert p.collector == snap.collector and p.seq == snap.seq
        assert p.counters == snap.counters  # the collector's health rides on every part
        assert (p.dynamo_planes, p.drift_sources) == (snap.dynamo_planes, snap.drift_sources)
        mine = (*p.workers, *p.streams, *p.scheduler, *p.scheduler_errors, *p.dynamo, *p.drift)
        (w,) = {x.worker_id for x in mine}
        assert worker_bucket(w) == p.bucket
        assert [f.samples[0].labels["worker_id"] for f in p.passthrough] == [w]
        assert decode_snapshot(encode_snapshot(p)) == p
    merged = merge_parts(parts)
    assert merged.bucket == WHOLE
    assert (merged.dynamo_planes, merged.drift_sources) == (snap.dynamo_planes, snap.drift_sources)
    for field in (
        "workers",
        "streams",
        "scheduler",
        "scheduler_errors",
        "passthrough",
        "dynamo",
        "drift",
    ):
        got, want = getattr(merged, field), getattr(snap, field)
        assert sorted(map(encode_snapshot_part, got)) == sorted(map(encode_snapshot_part, want))


def encode_snapshot_part(x: object) -> bytes:
    return msgspec.msgpack.encode(x)


def test_one_bucket_and_no_worker_are_one_part() -> None:
    (p,) = split_parts(snapshot(workers=("w2",)))
    assert (p.bucket, p.buckets) == (18, [18])
    (empty,) = split_parts(snapshot(workers=()))
    assert (empty.bucket, empty.buckets) == (0, [0])  # its health still reaches shard 0


def test_a_bucket_outside_the_range_is_refused() -> None:
    bad = msgspec.structs.replace(snapshot(), bucket=BUCKETS)
    with pytest.raises(Exception, match="bucket"):
        decode_snapshot(encode_snapshot(bad))
    v1 = msgspec.structs.replace(snapshot(), version=1)
    assert decode_snapshot(encode_snapshot(v1)).bucket == WHOLE  # version 1: one whole part


def test_the_fleet_sees_a_collector_once_whatever_its_parts() -> None:
    whole, split = FleetState(), FleetState()
    whole.update(snapshot(), NOW)
    for p in split_parts(snapshot()):
        split.update(p, NOW)
    a, b = whole.view(NOW), split.view(NOW)
    assert [c.info.collector_id for c in b.collectors] == ["node-0"]
    assert [(s.stats, s.live) for s in a.streams] == [(s.stats, s.live) for s in b.streams]
    assert (a.owners, a.leaders, a.dp_size) == (b.owners, b.leaders, b.dp_size)
    assert active(a) == active(b) == split.conditions(NOW)


def test_parts_are_ordered_per_bucket_and_replaced_by_a_new_process() -> None:
    fs = FleetState()
    for p in split_parts(snapshot(seq=5)):
        fs.update(p, NOW)
    old = split_parts(snapshot(seq=4))[0]
    assert not fs.update(old, NOW)  # older than the part held for its bucket
    # the new process watches one worker only: its part replaces every part of the old one
    (new,) = split_parts(snapshot(seq=1, start=200.0, workers=("w2",)))
    assert fs.update(new, NOW)
    got = fs.snapshot("node-0")
    assert got is new
    assert not fs.update(split_parts(snapshot(seq=9))[1], NOW)  # the dead process's part


def test_a_bucket_the_collector_stopped_sending_is_dropped() -> None:
    fs = FleetState()
    for p in split_parts(snapshot(seq=1)):
        fs.update(p, NOW)
    # same process, now (after rediscovery, say) only w2's part, listing only its bucket
    (only,) = split_parts(snapshot(seq=2, workers=("w2",)))
    fs.update(only, NOW)
    got = fs.snapshot("node-0")
    assert got is not None and {w.worker_id for w in got.workers} == {"w2"}


def test_a_stale_part_makes_the_collector_stale() -> None:
    fs = FleetState(stale_intervals=3)
    a, b, c = split_parts(snapshot(seq=1))
    fs.update(a, NOW - 10)
    fs.update(b, NOW)
    fs.update(c, NOW)
    (cv,) = fs.view(NOW).collectors
    assert not cv.up and cv.age_s == 10


def test_shards_share_the_buckets_exactly() -> None:
    for n in (1, 2, 3, 4, 7, MAX_SHARDS):
        owned = [b for i in range(n) for b in shard_buckets(i, n)]
        assert sorted(owned) == list(range(BUCKETS))
    assert MAX_SHARDS == BUCKETS
    assert snapshot_subject("c", "n.1", 5) == "kvobserve.v1.c.snapshot.5.n_1"
    assert snapshot_subject("c", "n.1") == "kvobserve.v1.c.snapshot.n_1"  # version 1
    assert snapshot_wildcards("c") == ["kvobserve.v1.c.snapshot.*.*", "kvobserve.v1.c.snapshot.*"]
    assert snapshot_wildcards("c", 1, 32) == [
        "kvobserve.v1.c.snapshot.1.*",
        "kvobserve.v1.c.snapshot.33.*",
    ]
    assert (kv_key("n.1", 5), kv_key("n")) == ("5.n_1", "n")
    assert kv_filters() == [">"] and kv_filters(0, 32) == ["0.*", "32.*"]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVOBSERVE_AGGREGATOR_SHARDS": "0"},
         "KVOBSERVE_AGGREGATOR_SHARDS (aggregator.shards): must be >= 1, got 0"),
        ({"KVOBSERVE_AGGREGATOR_SHARDS": "65"},
         "KVOBSERVE_AGGREGATOR_SHARDS (aggregator.shards): must be <= 64, got 65"),
        ({"KVOBSERVE_AGGREGATOR_SHARD": "2", "KVOBSERVE_AGGREGATOR_SHARDS": "2"},
         "KVOBSERVE_AGGREGATOR_SHARD (aggregator.shard): 2 must be < "
         "KVOBSERVE_AGGREGATOR_SHARDS (aggregator.shards) (2)"),
        ({"KVOBSERVE_AGGREGATOR_SHARD": "x"},
         "KVOBSERVE_AGGREGATOR_SHARD (aggregator.shard): expected int, got 'x'"),
    ],
)  # fmt: skip
def test_shard_settings_are_checked(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        load_config(None, {}, env)
    ok = load_config(
        None, {}, {"KVOBSERVE_AGGREGATOR_SHARD": "3", "KVOBSERVE_AGGREGATOR_SHARDS": "4"}
    )
    assert (ok.aggregator.shard, ok.aggregator.shards) == (3, 4)


def test_the_rich_fleet_is_unchanged_by_the_parts() -> None:
    # rich_state's snapshots are version-2 wholes: one part each, kept as they are
    fs = rich_state()
    for cid in fs.collector_ids():
        snap = fs.snapshot(cid)
        assert snap is not None and snap.bucket == WHOLE
