"""What more memory would buy a pool run as one global cache: its curve, from the miss split.

The miss split's aggregator (analysis/miss_sample.py `SampledSplit`) replays every collector's
sampled top-tier changes in engine-time order. The same stream says when the *last* copy of a
sampled block left the pool (no rank holds it any more): the pool's ghost list, ordered by when
its last copy went, is the LRU stack of one cache as large as all the pool's ranks together just
below what they hold (docs/cache-analytics.md, "What more memory would buy"). A store of a block that another
rank holds (a placement miss) would have hit in such a cache; a capacity miss would have hit in
one of S blocks when `U + g + 1 <= S`: U the blocks resident anywhere in the pool (the union of
its ranks), g the ghosts whose last copy went after it. So

    HR(S) = (hits + placement misses + capacity misses of depth <= S) / lookups,

every miss weighed by 2^level when it was classified, as the split's counters are. Offline this
is within 0.32 points of a replay of one cache of S blocks, with random and cache-aware
routing. Per-rank curves are not this: they hold for the routing that was observed
(analysis/capacity.py), and under a cache-aware router they understate what more memory buys.

`PoolGhosts` is told by the split of each block that left, was stored again or entered, and
keeps the depths of the capacity misses in bins of 1/16 octave of blocks (`depths`, weighed).
Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from kvobserve.analysis.recency import RecencyStack

PER_OCTAVE = 16  # depth bins per doubling of blocks
SLOTS = 1 << 14  # the ghost list's ring: sampled ghosts older than this many evictions are dropped


def depth_bin(blocks: float) -> int:
    """The bin of a depth in blocks (>= 1)."""
    return int(PER_OCTAVE * math.log2(max(1.0, blocks)))


def bin_range(b: int) -> tuple[float, float]:
    """(low, high) blocks of a depth bin."""
    return 2.0 ** (b / PER_OCTAVE), 2.0 ** ((b + 1) / PER_OCTAVE)


def within(depths: dict[int, float], blocks: float) -> float:
    """The weighed misses of depth at most `blocks` (the bin holding it: its log-share)."""
    if math.isinf(blocks):
        return sum(depths.values())
    total = 0.0
    for b, w in depths.items():
        low, high = bin_range(b)
        if high <= blocks:
            total += w
        elif low < blocks:
            total += w * math.log2(blocks / low) / math.log2(high / low)
    return total


class PoolGhosts:
    """One pool's global ghost list over the sampled identities (48-bit) of the miss split."""

    def __init__(self) -> None:
        self.stack = RecencyStack(1.0, SLOTS, usual=1)  # one epoch per sampled ghost: exact
        self.union = 0  # sampled blocks resident on some rank of the pool
        self.depths: dict[int, float] = {}  # depth bin -> capacity misses (weighed)
        self.unplaced = 0.0  # capacity misses whose ghost had left the list (unlimited only)
        self.evicted = 0.0  # last copies gone (weighed) since the start or a resync: validity
        self.resyncs = 0

    def entered(self) -> None:
        """A sampled block that no rank held became resident on one."""
        self.union += 1

    def left(self, ident: int, weight: float, eviction: bool = True) -> None:
        """The last copy of a sampled block left the pool (an eviction, or a clear)."""
        self.union = max(0, self.union - 1)
        self.stack.trim(math.inf)  # hand out nothing: the ring drops only its oldest
        self.stack.push(ident, 1)
        if eviction:
            self.evicted += weight

    def restored(self, ident: int, scale: int) -> None:
        """A capacity miss of a sampled block (it left the pool before; no rank holds it):
        its depth in a global cache, weighed by `scale` (2^level)."""
        after = self.stack.pop(ident)
        if after is None:
            self.unplaced += scale
        else:
            d = depth_bin((self.union + after) * scale + 1)
            self.depths[d] = self.depths.get(d, 0.0) + scale
        self.union += 1

    def drop(self, idents: Iterable[int]) -> None:
        """Sampled blocks that left the sample (a higher level): no longer in the list."""
        for i in idents:
            self.stack.pop(i)

    def resynced(self, union: int) -> None:
        """A collector's ranks were replaced by a full delta: the union is recounted, and the
        evictions seen start again (what left meanwhile is not known)."""
        self.union = union
        self.evicted = 0.0
        self.resyncs += 1


@dataclass(frozen=True, slots=True)
class PoolDeltas:
    """One pool's global-cache data over a window (analysis/capacity_fleet.py: since observed);
    misses are weighed blocks, hits the engines' counters in blocks."""

    hits: float
    compulsory: float
    capacity: float
    placement: float
    depths: dict[int, float]  # capacity misses by depth bin
    blocks: float  # the pool's total capacity in blocks (factor 1)
    stores: float | None = None  # the blocks stored, exactly (the ranks' curves), when known

    @property
    def misses(self) -> float:
        """Every miss (weighed)."""
        return self.compulsory + self.capacity + self.placement

    @property
    def lookups(self) -> float:
        """Blocks looked up: hits and every miss (the exact stores where known)."""
        return self.hits + (self.stores if self.stores is not None else self.misses)

    def at(self, factor: float) -> float | None:
        """The hit rate of one cache of `factor` x the pool's total capacity; with the exact
        stores, the sampled shares are scaled to them (a ratio estimator)."""
        if self.lookups <= 0:
            return None
        extra = self.capacity if math.isinf(factor) else within(self.depths, factor * self.blocks)
        scale = self.stores / self.misses if self.stores is not None and self.misses else 1.0
        return (self.hits + scale * (self.placement + extra)) / self.lookups
