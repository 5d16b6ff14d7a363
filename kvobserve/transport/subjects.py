"""kvobserve's NATS names: subjects and the JetStream KV bucket (docs/nats.md, docs/scale.md).

A collector publishes one snapshot part per shard bucket of its workers (`worker_bucket`,
wire/parts.py), on `kvobserve.v1.<cluster>.snapshot.<bucket>.<collector_id>`. Shard `i` of
`n` aggregators subscribes to the buckets `b` with `b % n == i`, so NATS delivers each worker to
exactly one shard; a single aggregator subscribes to every bucket, and to the version-1 subject
`kvobserve.v1.<cluster>.snapshot.<collector_id>` of older collectors. The aggregator asks every
collector where a request would hit on `kvobserve.v1.<cluster>.overlap` (request-reply).
"""

from __future__ import annotations

import re

from kvobserve.wire.snapshot import BUCKETS, WHOLE

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def subject_token(value: str) -> str:
    """`value` as one NATS subject token (and KV key): anything but [A-Za-z0-9_-] becomes '_'."""
    return _UNSAFE.sub("_", value) or "_"


def snapshot_subject(cluster: str, collector_id: str, bucket: int = WHOLE) -> str:
    """The subject one collector publishes a part on (WHOLE: version 1's unsplit subject)."""
    head = f"kvobserve.v1.{subject_token(cluster)}.snapshot"
    if bucket == WHOLE:
        return f"{head}.{subject_token(collector_id)}"
    return f"{head}.{bucket}.{subject_token(collector_id)}"


def shard_buckets(shard: int, shards: int) -> list[int]:
    """The buckets shard `shard` of `shards` serves."""
    return [b for b in range(BUCKETS) if b % shards == shard]


def snapshot_wildcards(cluster: str, shard: int = 0, shards: int = 1) -> list[str]:
    """What shard `shard` of `shards` subscribes to (one aggregator: every bucket and v1)."""
    head = f"kvobserve.v1.{subject_token(cluster)}.snapshot"
    if shards == 1:
        return [f"{head}.*.*", f"{head}.*"]
    return [f"{head}.{b}.*" for b in shard_buckets(shard, shards)]


def kv_key(collector_id: str, bucket: int = WHOLE) -> str:
    """The KV key of a collector's part: `<bucket>.<collector>` (WHOLE: the collector id)."""
    token = subject_token(collector_id)
    return token if bucket == WHOLE else f"{bucket}.{token}"


def kv_filters(shard: int = 0, shards: int = 1) -> list[str]:
    """The KV key filters shard `shard` of `shards` reads at a warm start (">": every key)."""
    return [">"] if shards == 1 else [f"{b}.*" for b in shard_buckets(shard, shards)]


def event_subject(cluster: str, kind: str) -> str:
    """The subject condition transitions of `kind` are published on."""
    return f"kvobserve.v1.{subject_token(cluster)}.event.{subject_token(kind)}"


def event_wildcard(cluster: str) -> str:
    """Every condition transition of a cluster."""
    return f"kvobserve.v1.{subject_token(cluster)}.event.*"


def misses_subject(cluster: str) -> str:
    """The subject the aggregator tells every collector the miss split's levels and resyncs on
    (wire/misses.py MissFeedback); sharded aggregators each publish their pools' here."""
    return f"kvobserve.v1.{subject_token(cluster)}.misses"


def overlap_subject(cluster: str) -> str:
    """Where the aggregator asks every collector where a request would hit (request-reply:
    every collector answers on the question's reply subject)."""
    return f"kvobserve.v1.{subject_token(cluster)}.overlap"


def kv_bucket(cluster: str) -> str:
    """The JetStream KV bucket holding the last snapshot per collector."""
    return f"kvobserve_snapshots_{subject_token(cluster)}"
