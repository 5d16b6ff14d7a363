"""The sampled residency deltas a collector ships for the miss split across collectors.

One `MissDelta` per pool and interval, in the collector's snapshot (`Snapshot.misses`): the
top-tier stores, removals and clears of the collector's ranks of the pool for the block hashes in
the sample (analysis/miss_sample.py), in the order the collector applied them, as fixed 10-byte
records (`RECORD`):

| bytes | field | meaning |
|---|---|---|
| 2 | `ms` | engine time of the batch, milliseconds after `MissDelta.base` (a delta spans < 65 s) |
| 1 | `rank` | index into `MissDelta.ranks` (the dp ranks; of `MissDelta.workers`, same index) |
| 1 | `op` | 0 store, 1 removal, 2 clear (of that rank's top tier; `key` 0) |
| 6 | `key` | the top 48 bits of the hash's 64-bit sample key (low 4 bytes, then high 2) |

The 48 bits are the block's identity in the sample (two sampled blocks of a pool share them with
probability n^2 / 2^49: none in practice, where n is a few thousand) and give its bucket.

A `full` delta carries, instead of changes, every sampled block resident on its ranks at
`until` (op 0): the aggregator replaces what it holds for those ranks (a resync after a lost
delta). Map-encoded like the snapshot, so fields can be added; `seq` counts a collector's deltas
of one pool from 1, so a lost one shows.

`MissFeedback` goes the other way, from the aggregator to every collector (the NATS subject
`kvobserve.v1.<cluster>.misses`, transport/subjects.py; in one process, the in-process bus):
each pool's sample level, and which collectors should send a full delta of which pools.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import NamedTuple

import msgspec
from msgspec import Struct

from kvobserve.wire.errors import decode

RECORD = struct.Struct("<HBBIH")
STORE, REMOVE, CLEAR = 0, 1, 2
MAX_DELTA_BYTES = 16 * 1024 * 1024
MAX_MS = (1 << 16) - 1  # 65 s after `base`: a delta spans one snapshot interval


class MissDelta(Struct, omit_defaults=True, gc=False):
    """One collector's sampled top-tier changes of one pool since its previous delta."""

    pool: str  # the pool ([worker] pool; by default the worker's id)
    seq: int  # from 1 per (collector process, pool)
    level: int  # the collector's sample level: buckets >= level are in it
    base: float  # engine seconds of `us` 0
    until: float  # every batch at or before this engine time is in this delta or an earlier one
    ranks: list[int] = []  # dp ranks the records index
    ops: bytes = b""  # RECORD after RECORD
    full: bool = False  # the sampled resident sets of `ranks` at `until`, not changes
    workers: list[str] = []  # the worker of each of `ranks` ("" or none: the worker `pool`)
    # blocks each of `ranks` stored in this delta, every one (not only the sampled): the exact
    # count the capacity curve scales its sampled shares to; empty without the curve. On the
    # wire as `n`: it rides in nearly every delta, and its name was most of its bytes
    stored: list[int] = msgspec.field(default_factory=list, name="n")

    def rank_keys(self) -> list[tuple[str, int]]:
        """(worker_id, dp_rank) of each of `ranks`."""
        w = self.workers
        return [(w[i] if i < len(w) and w[i] else self.pool, r) for i, r in enumerate(self.ranks)]


class MissFeedback(Struct, omit_defaults=True, gc=False):
    """The aggregator's word to the collectors about the sampled split (every interval)."""

    levels: dict[str, int] = {}  # pool -> the aggregator's sample level: ship no bucket below
    resync: dict[str, list[str]] = {}  # collector id -> pools to send a full delta of


class Op(NamedTuple):
    """One decoded record, its time made absolute, its rank as (worker_id, dp_rank)."""

    ts: float
    rank: tuple[str, int]
    op: int
    key: int  # the top 48 bits of the sample key


def pack_op(out: bytearray, ms: int, rank_index: int, op: int, key: int) -> None:
    """Append one record to `out` (`key`: a 64-bit sample key; its top 48 bits are kept)."""
    k = key >> 16
    out += RECORD.pack(min(max(ms, 0), MAX_MS), rank_index, op, k & 0xFFFFFFFF, k >> 32)


def iter_ops(d: MissDelta) -> Iterator[Op]:
    """The delta's records in order; a record whose rank index is out of range is skipped."""
    ranks, base = d.rank_keys(), d.base
    n = len(d.ops) - len(d.ops) % RECORD.size
    for ms, ri, op, lo, hi in RECORD.iter_unpack(d.ops[:n]):
        if ri < len(ranks):
            yield Op(base + ms / 1e3, ranks[ri], op, hi << 32 | lo)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(MissDelta)
_feedback = msgspec.msgpack.Decoder(MissFeedback)
MAX_FEEDBACK_BYTES = 1024 * 1024


def encode_delta(d: MissDelta) -> bytes:
    """msgpack bytes of a delta."""
    return _encoder.encode(d)


def decode_delta(data: bytes) -> MissDelta:
    """A delta from msgpack; raises WireError only."""
    delta: MissDelta = decode(_decoder, data, "miss_delta", MAX_DELTA_BYTES)
    return delta


def encode_feedback(f: MissFeedback) -> bytes:
    """msgpack bytes of the aggregator's feedback."""
    return _encoder.encode(f)


def decode_feedback(data: bytes) -> MissFeedback:
    """The aggregator's feedback from msgpack; raises WireError only."""
    fb: MissFeedback = decode(_feedback, data, "miss_feedback", MAX_FEEDBACK_BYTES)
    return fb
