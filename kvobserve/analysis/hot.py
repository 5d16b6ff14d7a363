"""Hot prefixes: the block hashes stored most often, by a bounded frequent-items summary.

A block hash names its whole prefix (the engines chain hashes). One `HotBlocks` per stream counts
the prefixes computed again although the worker had held them: per top-tier store that restores
blocks removed within the window, or stores blocks another rank of the worker holds, the first
such block (SGLang: the page; vLLM: where the recomputed run began). It keeps at most `capacity`
counters. When full, the batch decrement of Misra-Gries runs: the third-quartile
count is subtracted from every counter and the ones at or below it are dropped, so each count
is a lower bound and the true count is at most `count + offset` (docs/cache-analytics.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from heapq import nlargest
from operator import itemgetter

from kvobserve.wire.kv_events import BlockHash

DEFAULT_CAPACITY = 64
DEFAULT_TOP = 16
_count = itemgetter(1)


class HotBlocks:
    """Store counts of the most frequent block hashes of one stream."""

    __slots__ = ("capacity", "counts", "offset", "total")

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = max(2, capacity)
        self.counts: dict[BlockHash, int] = {}
        self.offset = 0  # sum of the decrements: the bound on any count's shortfall
        self.total = 0  # stores counted

    def add(self, h: BlockHash) -> None:
        """One store of `h`."""
        counts = self.counts
        n = counts.get(h)
        if n is not None:
            counts[h] = n + 1
        else:
            if len(counts) >= self.capacity:
                self._decrement()
            counts[h] = 1
        self.total += 1

    def _decrement(self) -> None:
        counts = self.counts
        cut = sorted(counts.values())[len(counts) * 3 // 4]  # keep the top quarter
        for h, n in list(counts.items()):
            if n <= cut:
                del counts[h]
            else:
                counts[h] = n - cut
        self.offset += cut

    def top(self, k: int = DEFAULT_TOP) -> list[tuple[BlockHash, int]]:
        """The `k` largest (hash, count) pairs, largest first (counts are lower bounds)."""
        return nlargest(k, self.counts.items(), key=_count)

    def clear(self) -> None:
        """Forget everything (a restarted publisher's hashes start over)."""
        self.counts.clear()


def merge_top(
    lists: Iterable[tuple[Iterable[tuple[BlockHash, int, int]], int, str]], k: int
) -> tuple[list[tuple[BlockHash, int, int]], int]:
    """Merge per-stream tops `([(hash, stores, holders)], offset, collector)`: the k largest
    and the bound.

    A hash missing from one stream's list may still have up to that stream's offset stores
    there, so the merged bound is the sum of the offsets. `holders` counts the ranks of one
    collector that hold the hash, the same for every stream of that collector: it is taken once
    per collector (the largest seen) and summed over collectors.
    """
    stores: dict[BlockHash, int] = {}
    held_in: dict[tuple[BlockHash, str], int] = {}
    bound = 0
    for entries, offset, collector in lists:
        bound += offset
        for h, n, held in entries:
            stores[h] = stores.get(h, 0) + n
            key = (h, collector)
            if held > held_in.get(key, 0):
                held_in[key] = held
    holders: dict[BlockHash, int] = {}
    for (h, _), held in held_in.items():
        holders[h] = holders.get(h, 0) + held
    best = nlargest(k, stores.items(), key=_count)
    return [(h, n, holders.get(h, 0)) for h, n in best], bound
