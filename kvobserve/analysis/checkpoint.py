"""One stream's checkpoint: what is copied of its state, and how a new index takes it back.

Three steps, each pure:

1. `copy_stream` on the ingest thread, between two batches: a consistent copy of what a
   restarted collector needs (every tier's resident hashes and store times as plain lists, the
   odd token counts, LoRA blocks, the last seq, its engine time and payload, the trust state).
   It is C-level list copies only (20-80 ns a block), so the ingest thread pays little; the
   copy shares the hash and time objects with the index and is never written to.
2. `encode_copy` on any thread (the writer's): the copy packed into the file's bytes
   (wire/checkpoint.py), about 60 ns a block more.
3. `restore_index` into a new, empty `BlockIndex` at start, from a checkpoint that
   `decode_checkpoint` accepted for this stream and configuration.

What resumes with the index (docs/reliability.md, "Restarts of kvobserve"): the resident blocks
of every tier with their store times (so the lifetimes of blocks stored before the restart are
observed right when they leave), the usual block size and odd token counts, the LoRA blocks
by adapter. Counters (batches, stored and removed totals, histograms) do not: they count from
each process's start. The restore window of recent removals (thrash) is not kept; instead the
analytics' silent-loss evidence waits one window (`CacheAnalytics.resumed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvobserve.analysis.blocks import BlockIndex
from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.wire.checkpoint import (
    PublisherIdentity,
    StreamCheckpoint,
    StreamIdentity,
    TierState,
    encode_checkpoint,
    pack_hashes,
    pack_times,
    unpack_hashes,
    unpack_times,
)
from kvobserve.wire.kv_events import BlockHash


@dataclass(slots=True)
class TierCopy:
    """One tier's state as copied on the ingest thread (lists in the index's order)."""

    medium: str
    hashes: list[BlockHash]
    stored_at: list[float]
    odd_hashes: list[BlockHash]
    odd_tokens: list[int]
    lora: dict[BlockHash, str] = field(default_factory=dict)  # LoRA blocks -> adapter


@dataclass(slots=True)
class StreamCopy:
    """A consistent copy of one stream's state, taken between two batches."""

    identity: StreamIdentity
    config: str  # the fingerprint of the settings that shape the index
    publisher: PublisherIdentity
    last_seq: int
    last_ts: float | None
    anchor: bytes
    trust_state: str
    trust_reason: str
    block_size: int
    tiers: list[TierCopy]

    @property
    def blocks(self) -> int:
        """Resident blocks over every tier."""
        return sum(len(t.hashes) for t in self.tiers)


def state_mark(sq: StreamSequencer) -> tuple[int, int, int | None, str, str]:
    """A value that changes whenever what a checkpoint of `sq` holds does (cheap: no walk)."""
    return (sq.batches_applied, sq.restarts, sq.last_seq, sq.trust.state, sq.trust.reason)


def copy_stream(
    identity: StreamIdentity,
    sq: StreamSequencer,
    anchor: bytes | None,
    config: str,
    publisher: PublisherIdentity | None = None,
) -> StreamCopy | None:
    """The state of `sq` to checkpoint, or None when there is nothing to resume from: no batch
    applied yet, or no payload of the last one (`anchor`: the payload of `sq.last_seq`, which a
    resume must find again at the head of the replay ring; `config`: the fingerprint of the
    settings that shape the index)."""
    if sq.last_seq is None or anchor is None:
        return None
    idx = sq.index
    lora_of = idx.analytics.lora_of if idx.analytics is not None else {}
    tiers = [
        TierCopy(
            name,
            list(t.resident),
            list(t.resident.values()),
            list(t.odd),
            list(t.odd.values()),
            dict(lora_of[name]) if lora_of.get(name) else {},
        )
        for name, t in idx.tiers.items()
    ]
    return StreamCopy(
        identity,
        config,
        publisher or PublisherIdentity(),
        sq.last_seq,
        sq.last_ts,
        anchor,
        sq.trust.state,
        sq.trust.reason,
        idx.block_size,
        tiers,
    )


def _tier_state(t: TierCopy) -> TierState:
    hashes, blob, width = pack_hashes(t.hashes)
    low, mid, top = pack_times(t.stored_at)
    lora: dict[str, list[BlockHash]] = {}
    for h, name in t.lora.items():
        lora.setdefault(name, []).append(h)
    return TierState(
        t.medium, len(t.hashes), hashes, blob, width, low, mid, top,
        t.odd_hashes, t.odd_tokens, lora,
    )  # fmt: skip


def checkpoint_of(copy: StreamCopy, version: str, written_at: float) -> StreamCheckpoint:
    """The checkpoint of a copy (`version`: kvobserve's, `written_at`: wall clock)."""
    return StreamCheckpoint(
        copy.identity, copy.config, version, written_at, copy.publisher, copy.last_seq,
        copy.last_ts, copy.anchor, copy.trust_state, copy.trust_reason, copy.block_size,
        [_tier_state(t) for t in copy.tiers],
    )  # fmt: skip


def encode_copy(copy: StreamCopy, version: str, written_at: float) -> bytes:
    """The file's bytes for a copy."""
    return encode_checkpoint(checkpoint_of(copy, version, written_at))


def restore_index(ck: StreamCheckpoint, index: BlockIndex) -> int:
    """Fill the empty `index` with the checkpoint's resident blocks (and its analytics' LoRA
    blocks, with the silent-loss evidence held for one window); returns the blocks restored."""
    tiers = []
    for t in ck.tiers:
        resident = dict(zip(unpack_hashes(t), unpack_times(t), strict=True))
        odd = dict(zip(t.odd_hashes, t.odd_tokens, strict=True))
        if not odd.keys() <= resident.keys():  # the decoder checked lengths, not membership
            odd = {h: n for h, n in odd.items() if h in resident}
        tiers.append((t.medium, resident, odd))
    index.restore(ck.block_size, tiers)
    a = index.analytics
    if a is not None:
        if ck.last_ts is not None:
            a.resumed(ck.last_ts)
        for t in ck.tiers:
            if t.lora and t.medium in index.tiers:
                a.restore_lora(t.medium, t.lora)
    return sum(len(r) for _, r, _ in tiers)
