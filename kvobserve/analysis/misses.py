"""Where the misses come from: every block a pool's ranks store, classified, within one collector.

A pool is the set of ranks a router could have sent a request to. Each top-tier block a rank
stores (a store of a block not resident on that rank: the engine computed it) is one miss of:

- `placement`: resident right now on another rank of the pool (a router that knew would have hit);
- `capacity`: not resident anywhere now, but resident before somewhere in the pool (more cache
  would have helped);
- `compulsory`: never resident anywhere in the pool before (new content).

The residency "now" is the ranks' own block indexes (`BlockIndex`, the top tier's resident dict),
read in place: nothing is copied. "Before" is the pool's `seen` set of every hash ever stored on
one of its ranks. Exact, given the order in which the collector applies the ranks' batches (the
same caveat as `recomputed_elsewhere`, docs/cache-analytics.md).

Cost: one set entry per distinct block the pool ever stored. The hash object is shared with the
index while the block is resident, so an entry costs a set slot (8-byte pointer + 8-byte cached
hash, at a load of at most 3/5: 27-53 bytes) and, once the block has left every rank, the hash
object too (32 bytes for an int hash, 65 for 32 bytes): about 60-90 bytes per distinct block in
all, growing with the distinct content the pool has seen (`python -m benchmarks.misses` measures
it). Per store event: a C-level `isdisjoint` against the rank's own, each peer's and the seen
set; per-hash Python work only where a hash is found on a peer or in `seen`.

Across collectors the same split is estimated from hash-sampled exact sets (analysis/miss_sample.py).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from kvobserve.wire.kv_events import BlockHash

KINDS = ("compulsory", "capacity", "placement")


@dataclass(slots=True)
class MissCounts:
    """Misses of one rank (or a pool) by kind, in blocks."""

    compulsory: int = 0
    capacity: int = 0
    placement: int = 0

    @property
    def total(self) -> int:
        """All misses (= top-tier blocks stored)."""
        return self.compulsory + self.capacity + self.placement

    def add(self, other: MissCounts) -> None:
        """Add another count into this one."""
        self.compulsory += other.compulsory
        self.capacity += other.capacity
        self.placement += other.placement

    def as_dict(self) -> dict[str, int]:
        """Kind -> blocks."""
        return {
            "compulsory": self.compulsory,
            "capacity": self.capacity,
            "placement": self.placement,
        }


class Indexed(Protocol):
    """What the pool needs of a rank's block index (`analysis.blocks.BlockIndex`)."""

    misses: RankMisses | None

    @property
    def tiers(self) -> dict[str, Any]:
        """Medium -> tier (`.resident`: hash -> store time)."""
        ...


class RankMisses:
    """One rank's part of a pool: its counts, and its peers' tiers (the pool keeps them current).

    `BlockIndex` calls `on_store` before it applies a store to its top tier (`index.misses`).
    """

    __slots__ = ("counts", "key", "peers", "pool")

    def __init__(self, pool: PoolMisses, key: Hashable) -> None:
        self.pool = pool
        self.key = key
        self.counts = MissCounts()
        self.peers: list[dict[str, Any]] = []  # the other ranks' tiers (BlockIndex._tiers)

    def on_store(
        self, medium: str, resident: dict[BlockHash, Any], hashes: list[BlockHash]
    ) -> None:
        """Classify the hashes of a top-tier store that are not resident on this rank yet."""
        if not hashes:
            return
        new = (
            hashes
            if resident.keys().isdisjoint(hashes)
            else [h for h in hashes if h not in resident]
        )
        if not new:
            return
        c = self.counts
        rest = new
        others = [t.resident for p in self.peers if (t := p.get(medium)) is not None and t.resident]
        if others and not all(o.keys().isdisjoint(new) for o in others):
            rest = [h for h in new if not any(h in o for o in others)]
            c.placement += len(new) - len(rest)
        seen = self.pool.seen
        if rest:
            if seen.isdisjoint(rest):
                c.compulsory += len(rest)
            else:
                comp = sum(1 for h in rest if h not in seen)
                c.compulsory += comp
                c.capacity += len(rest) - comp
        seen.update(new)


class PoolMisses:
    """The miss split of one pool's ranks in this collector; `attach` each rank's index."""

    def __init__(self) -> None:
        self.seen: set[BlockHash] = set()  # every hash ever stored on a rank of the pool
        self.ranks: dict[Hashable, RankMisses] = {}
        self._indexes: dict[Hashable, Indexed] = {}

    def attach(self, key: Hashable, index: Indexed) -> RankMisses:
        """Classify the stores of `index` as the rank `key` of this pool (a second attach of a
        key replaces its index and keeps its counts)."""
        rm = self.ranks.get(key)
        if rm is None:
            rm = self.ranks[key] = RankMisses(self, key)
        old = self._indexes.get(key)
        if old is not None and old is not index:
            old.misses = None
        self._indexes[key] = index
        index.misses = rm
        self._link()
        return rm

    def detach(self, key: Hashable) -> None:
        """Stop classifying `key`'s stores; its counts stay (they are cumulative)."""
        index = self._indexes.pop(key, None)
        if index is not None:
            index.misses = None
        self._link()

    def _link(self) -> None:
        for key, rm in self.ranks.items():
            rm.peers = [ix.tiers for k, ix in self._indexes.items() if k != key]

    def totals(self, keys: Iterable[Hashable] | None = None) -> MissCounts:
        """The pool's counts (or those of `keys`)."""
        out = MissCounts()
        for key in self.ranks if keys is None else keys:
            rm = self.ranks.get(key)
            if rm is not None:
                out.add(rm.counts)
        return out
