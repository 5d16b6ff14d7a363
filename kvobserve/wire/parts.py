"""Snapshot parts for sharded aggregators: a worker's bucket, a snapshot split per bucket, and
one collector's parts merged again (docs/scale.md)."""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import msgspec

from kvobserve.wire.snapshot import BUCKETS, WHOLE, Family, Snapshot


@functools.lru_cache(maxsize=65_536)
def worker_bucket(worker_id: str) -> int:
    """The shard bucket of a worker: the same in every process and version (not hash()).

    BLAKE2b, not CRC-32: CRC is linear, so ids that differ in a few bits (`sglang-000`,
    `sglang-001`, ...) would share the low bits of their CRC, and so their shard.
    """
    digest = hashlib.blake2b(worker_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % BUCKETS


def split_parts(snap: Snapshot) -> list[Snapshot]:
    """One part per bucket of the snapshot's workers (a worker-less collector: bucket 0).

    Each part carries the collector's identity, seq, counters, refusals, its Dynamo planes and
    drift sources (collector-level, like the counters); the first part also the events not about
    one worker; and
    only its workers' streams, unexpected streams, scheduler stats, errors, scheduler sources'
    states, placement, passthrough families, Dynamo stream stats, drift results, bound
    endpoints and events.
    """
    by: dict[int, list[str]] = {}
    for w in snap.workers:
        by.setdefault(worker_bucket(w.worker_id), []).append(w.worker_id)
    for items in _per_worker(snap):
        for x in items:
            by.setdefault(worker_bucket(x.worker_id), [])
    for d in snap.misses:  # a pool's deltas go to the shard of the pool's name
        by.setdefault(worker_bucket(d.pool), [])
    if not by:
        by[0] = []
    buckets = sorted(by)
    if len(buckets) == 1:
        return [msgspec.structs.replace(snap, bucket=buckets[0], buckets=buckets)]
    out = []
    for b in buckets:

        def mine(worker_id: str, b: int = b) -> bool:
            return worker_bucket(worker_id) == b

        out.append(
            msgspec.structs.replace(
                snap,
                workers=[w for w in snap.workers if mine(w.worker_id)],
                streams=[x for x in snap.streams if mine(x.worker_id)],
                unexpected=[x for x in snap.unexpected if mine(x.worker_id)],
                scheduler=[x for x in snap.scheduler if mine(x.worker_id)],
                scheduler_errors=[x for x in snap.scheduler_errors if mine(x.worker_id)],
                passthrough=[f for f in snap.passthrough if _family_bucket(f) == b],
                dynamo=[x for x in snap.dynamo if mine(x.worker_id)],
                drift=[x for x in snap.drift if mine(x.worker_id)],
                sources=[x for x in snap.sources if mine(x.worker_id)],
                placement=[x for x in snap.placement if mine(x.worker_id)],
                binds=[x for x in snap.binds if mine(x.worker_id)],
                prefix=[x for x in snap.prefix if mine(x.worker_id)],
                misses=[d for d in snap.misses if mine(d.pool)],
                events=[
                    x
                    for x in snap.events
                    if (mine(x.worker_id) if x.worker_id else b == buckets[0])
                ],
                bucket=b,
                buckets=buckets,
            )
        )
    return out


def _family_bucket(f: Family) -> int | None:
    """The bucket of a passthrough family (its samples carry the worker_id label; none: dropped)."""
    for s in f.samples:
        w = s.labels.get("worker_id")
        if w is not None:
            return worker_bucket(w)
    return None


def merge_parts(parts: list[Snapshot]) -> Snapshot:
    """One collector's parts (same process, in bucket order) as one snapshot."""
    last = max(parts, key=lambda p: p.seq)
    return msgspec.structs.replace(
        last,
        time=max(p.time for p in parts),
        workers=[x for p in parts for x in p.workers],
        streams=[x for p in parts for x in p.streams],
        unexpected=[x for p in parts for x in p.unexpected],
        scheduler=[x for p in parts for x in p.scheduler],
        scheduler_errors=[x for p in parts for x in p.scheduler_errors],
        passthrough=[x for p in parts for x in p.passthrough],
        dynamo=[x for p in parts for x in p.dynamo],
        drift=[x for p in parts for x in p.drift],
        sources=[x for p in parts for x in p.sources],
        placement=[x for p in parts for x in p.placement],
        binds=[x for p in parts for x in p.binds],
        prefix=[x for p in parts for x in p.prefix],
        misses=[x for p in parts for x in p.misses],
        events=sorted({x.seq: x for p in parts for x in p.events}.values(), key=lambda x: x.seq),
        bucket=WHOLE,
    )


def _per_worker(snap: Snapshot) -> tuple[list[Any], ...]:
    """The snapshot's lists whose items belong to one worker (`worker_id`) each."""
    return (
        snap.streams, snap.unexpected, snap.scheduler, snap.scheduler_errors, snap.dynamo,
        snap.drift, snap.sources, snap.placement, snap.binds, snap.prefix,
    )  # fmt: skip
