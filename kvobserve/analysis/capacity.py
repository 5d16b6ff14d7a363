"""What more (or less) KV memory would buy a rank: its hit-rate curve, from its own events.

In an engine whose eviction follows recency (vLLM's free queue, SGLang's radix leaf LRU: the
engine profile's `recency_eviction`), the blocks a rank evicted and has not stored again, in the
order it evicted them (the *ghost list*), are exactly its LRU stack just below its capacity C.
So a block stored again after its eviction would still have been resident in a cache of C + g
tokens, where g is the tokens of the ghosts evicted after it plus its own: with the engine's hit
counter for C itself, `HR(m C) = (hits + stores with g <= (m - 1) C) / (hits + stores)`
(docs/cache-analytics.md "What more memory would buy"; `benchmarks/capacity.py` holds it to
the simulator's replays). A block stored again after it left the horizon (below) would
hit only with unlimited memory; one never evicted here is new to the rank.

`RankCurve` follows one rank's top tier for that, fed by its pool's miss sampler
(analysis/miss_sample.py `RankTap`), which hands it the sampled keys of each store and removal
it already computed:

- **The sample.** A block is followed when its 64-bit key falls below 2^(64 - level) (the miss
  split's geometric sample at a fixed level, default 4: 1/16 of the blocks). Depths are the
  sampled ghost tokens times 2^level; the share of stores that would hit is the sampled
  re-stores over the sampled stores, times the exact store count (a ratio estimator).
- **The ghost list** is a `RecencyStack` (analysis/recency.py) in epochs of 1/256 of the basis,
  kept up to a horizon of (8 - 1) x the basis: the 8x point needs no more. The basis is the
  rank's configured capacity, else the most top-tier tokens it has held (an engine evicts only
  when full). Ghosts older than the horizon stay as keys only ("beyond": the unlimited point),
  at most one per 2^level basis blocks (so ghosts and these stay within half an entry per
  resident block at 1/16); past that, a coarser sub-sample of them is kept (its own level,
  `beyond_level`), and each one found counts 2^(beyond_level - level).
- **Depths** are kept as counts per bin of x = g / basis, 8 bins per octave from 2^-5 to 2^3
  (`BINS`), so the aggregator reads any capacity, a tier's size included, from one histogram.
- **Below C** (opt-in, `below`): the first stored block's parent is the last block the request
  hit, and walking up the parents gives its whole hit path. The rank's resident blocks are kept
  with their parents (one dict entry per resident block: the reason it is opt-in) and the
  sampled ones by last access; each sampled block on a hit path counts its depth in `below`.
  A parent that is the block this rank stored last continues a chunked prefill, not a hit.
  Requests that hit fully and store nothing are invisible: the aggregator reports them as a band.

Validity (docs/cache-analytics.md): the point m C rests on (m - 1) C of evictions seen since the
start, a clear or a reset (`evicted`); a clear or a reset empties the ghost list (an
unlimited cache is emptied by it too). Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from kvobserve.analysis.placement import hash_key
from kvobserve.analysis.recency import RecencyStack
from kvobserve.analysis.tiers import TOP_MEDIA
from kvobserve.wire.capacity import RankCurveStats
from kvobserve.wire.kv_events import BlockHash

FACTORS = (1.25, 1.5, 2.0, 4.0, 8.0)  # capacity factors above 1 (plus 1 measured, and unlimited)
BELOW = (0.5, 0.75)  # below 1: estimates with a band (opt-in)
DEFAULT_LEVEL = 4  # 1/16 of the blocks
HORIZON = 8.0  # ghosts are kept up to (HORIZON - 1) x the basis: the largest factor
EPOCHS = 256  # ghost-list epochs per basis: depths exact to 1/512 of the basis
# depth bins: x = depth / basis; bin 0 below 2^-5, then 8 per octave up to 2^3, then one above
BIN_LOW, PER_OCTAVE, OCTAVES = -5, 8, 8
BINS = 2 + PER_OCTAVE * OCTAVES
_BIG = 1 << 64


def bin_of(x: float) -> int:
    """The bin of a depth x (in bases)."""
    if x < 2.0**BIN_LOW:
        return 0
    return min(BINS - 1, 1 + int(PER_OCTAVE * (math.log2(x) - BIN_LOW)))


def bin_edges(i: int) -> tuple[float, float]:
    """(low, high) of bin i in bases (bin 0 from 0; the last one to infinity)."""
    if i == 0:
        return 0.0, 2.0**BIN_LOW
    low = 2.0 ** (BIN_LOW + (i - 1) / PER_OCTAVE)
    high = math.inf if i == BINS - 1 else 2.0 ** (BIN_LOW + i / PER_OCTAVE)
    return low, high


def upto(counts: Sequence[float], x: float) -> float:
    """How many of the binned depths are at most x (in bases): whole bins below it, and of the
    bin holding x the share its log-width up to x covers (a bin 0 share: linear)."""
    if x <= 0 or not counts:
        return 0.0
    if math.isinf(x):
        return float(sum(counts))
    total = 0.0
    for i, c in enumerate(counts):
        low, high = bin_edges(i)
        if high <= x:
            total += c
            continue
        if c and low < x:
            if i == 0:
                total += c * x / high
            elif not math.isinf(high):
                total += c * math.log2(x / low) / math.log2(high / low)
        break
    return total


@dataclass(frozen=True, slots=True)
class CurveOptions:
    """Tunables of the per-rank curve (docs/cache-analytics.md)."""

    level: int = DEFAULT_LEVEL  # 2^-level of the blocks are followed; 0: every block
    horizon: float = HORIZON  # ghosts kept up to (horizon - 1) x the basis
    epochs: int = EPOCHS  # ghost-list epochs per basis
    interval_s: float = 60.0  # how often a collector ships the curves (they move slowly)

    def __post_init__(self) -> None:
        if not 0 <= self.level <= 32:
            raise ValueError(f"curve.level={self.level}: must be 0 .. 32")
        if self.horizon <= 1 or self.epochs < 1 or self.interval_s <= 0:
            raise ValueError("curve: horizon must be > 1, epochs >= 1, interval_s > 0")


DEFAULT_CURVE = CurveOptions()


def bucket(key: int) -> int:
    """The sample bucket of a 64-bit key: its leading zeros (miss_sample.bucket_of)."""
    return 64 - key.bit_length()


class RankCurve:
    """One rank's top tier, for its capacity curve; fed by its pool's `MissSampler`."""

    def __init__(
        self,
        options: CurveOptions = DEFAULT_CURVE,
        *,
        signed: bool = False,
        capacity_tokens: int = 0,
        below: bool = False,
        index: Any = None,
    ) -> None:
        self.options = o = options
        self.level = o.level
        self.limit = _BIG >> o.level  # a 64-bit key is followed iff key < limit
        self.signed = signed
        self.capacity = capacity_tokens  # configured; 0: the high-water mark stands for it
        self.index = index  # the rank's BlockIndex (read: top-tier tokens, the usual size)
        self.hw = 0  # the most top-tier tokens the rank held
        self.usual = 0
        self.ghosts = RecencyStack(1.0, 4096)
        self.stores = 0  # top-tier blocks stored (every hash of every store event)
        self.sampled_stores = 0
        self.restores = [0] * BINS  # sampled re-stores of ghosts, by depth bin
        self.beyond = 0.0  # re-stores past the horizon, each weighed 2^(beyond_level - level)
        self.beyond_level = o.level
        self._beyond: set[int] = set()  # keys that left the horizon (at beyond_level)
        self.evicted = 0  # top-tier blocks removed since the start, a clear or a reset
        self.resets = 0
        self._odd: dict[int, int] = {}  # sampled resident blocks whose tokens are not usual
        self._tier: Any = None
        # below C (opt-in): every resident block's parent, the sampled ones by last access
        self.below: list[int] | None = [0] * BINS if below else None
        self.walked = 0  # blocks on hit paths (every one: the hits of requests that stored)
        self.walked_sampled = 0  # the sampled ones (their depths are in `below`)
        self._parents: dict[BlockHash, BlockHash | None] = {}
        self._access = RecencyStack(1.0, 4096)
        self._last: BlockHash | None = None  # the block stored last (a chunk continues it)
        self._sized = 0  # the basis the epoch width was set for

    # --- the basis ----------------------------------------------------------------------------

    @property
    def basis(self) -> int:
        """Tokens the depths are measured in: the configured capacity, else the high-water
        mark of the rank's top tier."""
        return self.capacity or self.hw

    def _top_tokens(self) -> int:
        t = self._tier
        if t is None:
            index = self.index
            if index is None:
                return 0
            for name in ("GPU", *sorted(TOP_MEDIA - {"GPU"})):
                t = index.tiers.get(name)
                if t is not None:
                    self._tier = t
                    break
            else:
                return 0
        tokens: int = t.tokens
        return tokens

    def _resize(self) -> None:
        """The epoch width follows the basis: EPOCHS epochs per basis, in sampled tokens."""
        basis = self.basis
        self._sized = basis
        width = max(1.0, basis / self.options.epochs / (1 << self.level))
        self.ghosts.width = width
        self._access.width = width

    # --- input (the miss sampler calls these with the sampled keys) ---------------------------

    def stored(self, keys: list[int], n: int, size: int, parent: BlockHash | None,
               hashes: list[BlockHash]) -> None:  # fmt: skip
        """A top-tier store of `n` blocks of `size` tokens; `keys`: the sampled ones."""
        self.stores += n
        if size > self.usual:
            self._set_usual(size)
        if self.below is not None:
            self._walk(parent, size, hashes)
        if not keys:
            return
        self.sampled_stores += len(keys)
        ghosts, scale, basis = self.ghosts, 1 << self.level, self.basis or 1
        for k in keys:
            got = ghosts.pop(k)
            if got is not None:
                self.restores[bin_of((got * scale + size) / basis)] += 1
            elif self._beyond and k in self._beyond:
                self._beyond.discard(k)
                self.beyond += 1 << (self.beyond_level - self.level)
        if size != self.usual:
            self._odd.update(zip(keys, repeat(size)))
        if self.below is not None:
            access = self._access
            for k in keys:
                access.push(k, size)

    def removed(self, keys: list[int], hashes: list[BlockHash]) -> None:
        """A top-tier removal (evictions); `keys`: the sampled ones (the sampler counts a
        removal of none of them itself: `evicted`)."""
        self.evicted += len(hashes)
        tokens = self._top_tokens()  # after the batch: an engine that evicts is full again
        if tokens > self.hw:
            self.hw = tokens
        if self.basis > 2 * self._sized:
            self._resize()
        if self.below is not None:
            parents = self._parents
            if parents:
                list(map(parents.pop, hashes, repeat(None)))
            for k in keys:
                self._access.pop(k)
        if not keys:
            return
        ghosts, odd, usual = self.ghosts, self._odd, self.usual
        for k in keys:
            ghosts.push(k, odd.pop(k, usual) if odd else usual)
        horizon = (self.options.horizon - 1) * self.basis / (1 << self.level)
        if ghosts.tokens > horizon:
            self._past(ghosts.trim(horizon))

    def cleared(self) -> None:
        """The rank's top tier was emptied (a clear, or a new publisher): so is the ghost list
        (an unlimited cache is emptied too), and the evictions start again."""
        self.ghosts.clear()
        self._beyond.clear()
        self._odd.clear()
        self._parents.clear()
        self._access.clear()
        self._last = None
        self.evicted = 0
        self.beyond_level = self.level
        self.resets += 1

    # --- internals ----------------------------------------------------------------------------

    def _set_usual(self, size: int) -> None:
        self.usual = size
        self.ghosts.usual = size
        self._access.usual = size

    def _past(self, keys: list[int]) -> None:
        """Ghosts that left the horizon: a sample of them is kept (at `beyond_level`), at most
        one per 2^level blocks of the basis; past that the sample is thinned."""
        level = self.beyond_level
        kept = self._beyond
        kept.update(k for k in keys if bucket(k) >= level)
        cap = max(16, self.basis // max(1, self.usual) >> self.level)
        if len(kept) > cap:
            while len(kept) > cap // 2 and level < 64:
                level += 1
                kept = {k for k in kept if bucket(k) >= level}
            self._beyond, self.beyond_level = kept, level

    def _key(self, h: BlockHash) -> int:
        return hash_key(h, self.signed)

    def _walk(self, parent: BlockHash | None, size: int, hashes: list[BlockHash]) -> None:
        """Below C: the hit path of a store whose parent is a hit; then the new blocks."""
        parents = self._parents
        if parent is not None and parent != self._last and parent in parents:
            access, limit, scale = self._access, self.limit, 1 << self.level
            basis, usual, below = self.basis or 1, self.usual, self.below
            assert below is not None
            x: BlockHash | None = parent
            walked = 0
            for _ in range(len(parents)):  # a cycle cannot loop forever
                if x is None or x not in parents:
                    break
                walked += 1
                k = self._key(x)
                if k < limit:
                    got = access.pop(k)
                    if got is not None:
                        below[bin_of((got * scale + usual) / basis)] += 1
                        self.walked_sampled += 1
                    access.push(k, usual)
                x = parents[x]
            self.walked += walked
        if hashes:
            parents.update(zip(hashes, [parent, *hashes[:-1]], strict=True))
            self._last = hashes[-1]

    # --- output -------------------------------------------------------------------------------

    def stats(self, worker_id: str, dp_rank: int) -> RankCurveStats:
        """What a snapshot carries of this curve (wire/capacity.py)."""
        return RankCurveStats(
            worker_id, dp_rank, self.level, self.basis, bool(self.capacity), self.stores,
            self.sampled_stores, list(self.restores), self.beyond, self.evicted,
            self.evicted * self.usual, self.resets, len(self.ghosts), len(self._beyond),
            list(self.below) if self.below is not None else [], self.walked, self.walked_sampled,
            self.usual,
        )  # fmt: skip


# --- the aggregator's side: a rank's data since it was first seen ------------------------------


@dataclass(frozen=True, slots=True)
class RankDeltas:
    """One rank's curve data over a window (analysis/capacity_fleet.py: since observed)."""

    stores: float  # blocks stored
    sampled: float  # of which sampled
    restores: tuple[float, ...]  # sampled re-stores by depth bin (in bases)
    beyond: float  # weighed re-stores past the horizon
    basis: float  # tokens of one basis (the bins' unit)
    capacity: float  # tokens of the measured capacity C
    hits: float | None = None  # blocks hit (the engine's counter; None: not per rank)
    below: tuple[float, ...] = ()  # opt-in: sampled hit-path blocks by depth bin
    walked: float = 0.0  # opt-in: hit-path blocks of requests that stored (every one)
    walked_sampled: float = 0.0
    scale: float = 1.0  # 2^level

    def extra(self, factor: float) -> float:
        """Blocks stored that a cache of `factor` x C would have hit (factor >= 1)."""
        if not self.sampled or factor <= 1:
            return 0.0
        if math.isinf(factor):
            found = sum(self.restores) + self.beyond
        else:
            found = upto(self.restores, (factor - 1) * self.capacity / max(self.basis, 1.0))
        return self.stores * found / self.sampled

    def lost(self, factor: float) -> float:
        """Opt-in, factor < 1: hits of requests that stored something that a cache of
        `factor` x C would have missed (blocks)."""
        x = factor * self.capacity / max(self.basis, 1.0)
        return self.scale * max(0.0, self.walked_sampled - upto(self.below, x))

    def at(self, factor: float) -> float | None:
        """The hit rate at `factor` x C (>= 1; None without the rank's hits)."""
        if self.hits is None or self.hits + self.stores <= 0:
            return None
        return (self.hits + self.extra(factor)) / (self.hits + self.stores)

    def below_at(self, factor: float) -> tuple[float, float, float] | None:
        """(estimate, low, high) of the hit rate at `factor` x C < 1 (`below`)."""
        if self.hits is None:
            return None
        return below(self.hits, self.stores, self.walked, self.lost(factor))


def below(
    hits: float, stores: float, walked: float, lost: float
) -> tuple[float, float, float] | None:
    """(estimate, low, high) of a hit rate below C: of the `hits`, those of requests that stored
    something (`walked`) would lose `lost`; requests that hit fully and stored nothing are not
    seen (the rest of the hits): the estimate has them lose as the seen ones do, the band all or
    none of them."""
    if not walked or hits + stores <= 0:
        return None
    lookups = hits + stores
    lost = min(lost, walked)
    unseen = max(0.0, hits - walked)
    high = max(0.0, hits - lost)
    low = max(0.0, high - unseen)
    est = max(0.0, high - unseen * lost / walked)
    return est / lookups, low / lookups, high / lookups


@dataclass(frozen=True, slots=True)
class WorkerDeltas:
    """A worker's curve: each rank's memory scaled by the same factor, its hits summed (the
    worker's counter where the engine counts per worker)."""

    hits: float
    ranks: tuple[RankDeltas, ...]

    @property
    def stores(self) -> float:
        """Blocks stored by its ranks."""
        return sum(r.stores for r in self.ranks)

    @property
    def walked(self) -> float:
        """Opt-in: hit-path blocks of requests that stored, over its ranks."""
        return sum(r.walked for r in self.ranks)

    def at(self, factor: float) -> float | None:
        """The hit rate at `factor` x each rank's capacity (>= 1)."""
        lookups = self.hits + self.stores
        if lookups <= 0:
            return None
        return (self.hits + sum(r.extra(factor) for r in self.ranks)) / lookups

    def below_at(self, factor: float) -> tuple[float, float, float] | None:
        """(estimate, low, high) at `factor` x each rank's capacity < 1 (`below`)."""
        lost = sum(r.lost(factor) for r in self.ranks if r.walked)
        return below(self.hits, self.stores, self.walked, lost)
