"""Placement of a worker's blocks across its ranks: exact within a collector, a sketch across.

Within one collector the resident sets of a worker's ranks are at hand: `local_placement` counts
distinct hashes and how many sit on 2, 3, ... ranks exactly. Across collectors each ships a
bottom-k (KMV) sketch of the union of its ranks' top-tier hashes with, per entry, how many of
its ranks hold it; `merge_placement` unions them (docs/cache-analytics.md has the error bound).

Engine block hashes are already uniform (SHA-256 derived, or CPython's tuple hash for SGLang 0.4),
so the sketch uses them as they are, mapped to an unsigned 64-bit key: SGLang's signed int64 by
+2^63, vLLM's uint64 as is, 32-byte hashes by their first 8 bytes. Each mapping keeps the raw
order, so the k smallest raw values are the k smallest keys and no per-block work is needed
beyond one pass of `heapq.nsmallest`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from heapq import nsmallest
from itertools import chain

from kvobserve.wire.kv_events import BlockHash
from kvobserve.wire.snapshot import WorkerPlacement

_MASK = (1 << 64) - 1
_SIGN = 1 << 63
_SPACE = float(1 << 64)
MAX_COUNT = 0xFFFF  # holders per sketch entry (2 bytes)


def hash_key(v: BlockHash, signed: bool) -> int:
    """A block hash as an unsigned 64-bit key, in the raw order (SGLang's signed + 2^63)."""
    if isinstance(v, bytes):
        return int.from_bytes(v[:8], "big")
    return (v + _SIGN if signed else v) & _MASK


def _keys(values: Iterable[BlockHash], signed: bool) -> list[int]:
    return [hash_key(v, signed) for v in values]


def bottom_k(resident: Iterable[BlockHash], k: int, signed: bool) -> list[int]:
    """The k smallest keys of a set of block hashes, ascending."""
    ints: list[BlockHash] = []
    blobs: list[BlockHash] = []
    try:
        ints = nsmallest(k, resident)
    except TypeError:  # int and bytes hashes mixed: never from one engine, but do not crash
        ints = nsmallest(k, (h for h in resident if isinstance(h, int)))
        blobs = nsmallest(k, (h for h in resident if isinstance(h, bytes)))
    return sorted(_keys(chain(ints, blobs), signed))[:k]


def local_placement(
    worker_id: str,
    ranks: Mapping[int, Mapping[BlockHash, object]],
    *,
    k: int,
    signed: bool,
    sketch: bool,
    now: float = 0.0,
    recomputed_elsewhere: int = 0,
) -> WorkerPlacement:
    """Exact placement over `ranks` (rank -> top-tier resident hashes), with a sketch if asked."""
    sets = [s for s in ranks.values() if s]
    total = sum(len(s) for s in sets)
    replicated: dict[int, int] = {}
    if len(sets) <= 1:
        distinct = total
        holders: Mapping[BlockHash, int] = {}
    else:
        holders = Counter(chain.from_iterable(sets))
        distinct = len(holders)
        if distinct != total:
            replicated = dict(sorted(Counter(n for n in holders.values() if n > 1).items()))
    p = WorkerPlacement(
        worker_id,
        sorted(ranks),
        total,
        distinct,
        replicated,
        recomputed_elsewhere,
        computed_at=now,
    )
    if sketch:
        keys: dict[int, int] = {}
        for s in sets:
            for key in bottom_k(s, k, signed):
                keys[key] = keys.get(key, 0) + 1
        smallest = sorted(keys)[:k]
        p.sketch_k = k
        p.sketch = b"".join(key.to_bytes(8, "big") for key in smallest)
        p.sketch_counts = b"".join(min(keys[key], MAX_COUNT).to_bytes(2, "big") for key in smallest)
    return p


@dataclass
class PlacementEstimate:
    """A worker's placement over all collectors' ranks."""

    worker_id: str
    ranks: list[int] = field(default_factory=list)
    blocks_sum: int = 0
    blocks_distinct: float = 0.0
    replicated: dict[int, float] = field(default_factory=dict)
    recomputed_elsewhere: int = 0  # exact within each collector, summed
    exact: bool = True
    relative_error: float = 0.0  # one standard error of blocks_distinct, relative (0 if exact)

    @property
    def redundancy(self) -> float | None:
        """Resident blocks summed over ranks / distinct blocks (1.0 = no block on two ranks)."""
        return self.blocks_sum / self.blocks_distinct if self.blocks_distinct else None


def _decode(p: WorkerPlacement) -> dict[int, int]:
    keys, counts = p.sketch, p.sketch_counts
    return {
        int.from_bytes(keys[i * 8 : i * 8 + 8], "big"): int.from_bytes(
            counts[i * 2 : i * 2 + 2], "big"
        )
        for i in range(min(len(keys) // 8, len(counts) // 2))
    }


def merge_placement(entries: Sequence[WorkerPlacement]) -> PlacementEstimate:
    """One estimate from each collector's placement of one worker (ranks normally disjoint)."""
    est = PlacementEstimate(entries[0].worker_id)
    for p in entries:
        est.ranks.extend(p.ranks)
        est.blocks_sum += p.blocks_sum
        est.recomputed_elsewhere += p.recomputed_elsewhere
    est.ranks.sort()
    if len(entries) == 1:
        p = entries[0]
        est.blocks_distinct = float(p.blocks_distinct)
        est.replicated = {m: float(n) for m, n in p.replicated.items()}
        return est
    sketches = [_decode(p) for p in entries if p.sketch_k]
    if len(sketches) != len(entries):  # a collector sent no sketch: nothing better than bounds
        est.exact = False
        est.blocks_distinct = float(max(p.blocks_distinct for p in entries))
        est.relative_error = 1.0
        return est
    k = min(p.sketch_k for p in entries)
    union: dict[int, int] = {}
    for sk in sketches:
        for key, n in sk.items():
            union[key] = union.get(key, 0) + n
    full = any(len(sk) >= p.sketch_k for sk, p in zip(sketches, entries, strict=True))
    sample = sorted(union)[:k]
    if not full:  # every collector sent its whole set: exact
        est.blocks_distinct = float(len(union))
        mult = Counter(n for n in union.values() if n > 1)
        est.replicated = {m: float(c) for m, c in sorted(mult.items())}
        return est
    est.exact = False
    u = (sample[-1] + 1) / _SPACE
    est.blocks_distinct = (k - 1) / u
    est.relative_error = 1.0 / (k - 2) ** 0.5 if k > 2 else 1.0
    mult = Counter(union[key] for key in sample if union[key] > 1)
    est.replicated = {m: c / k * est.blocks_distinct for m, c in sorted(mult.items())}
    return est
