"""Per-worker sums of per-stream counters and lifetime histograms (the default series budget).

Each collector's streams are summed into one `WorkerSums`; a scrape merges them in collector
order, so the cached renderer and prometheus_client's path add the same floats in the same order.
"""

from __future__ import annotations

from functools import reduce
from itertools import accumulate
from operator import add, attrgetter

from kvobserve.export.cache import CacheSums
from kvobserve.wire.snapshot import Histogram

LIFETIME = "kvobserve_kv_block_lifetime_seconds"
# family -> the label that a worker's series keep besides worker_id
COUNTER_LABEL = {
    "kvobserve_kv_events_total": "type",
    "kvobserve_kv_blocks_stored_total": "medium",
    "kvobserve_kv_blocks_removed_total": "medium",
    "kvobserve_kv_blocks_unchanged_total": "kind",
}


_BOUNDS, _COUNTS = attrgetter("bounds"), attrgetter("counts")
_COUNT, _SUM = attrgetter("count"), attrgetter("sum")


class _Hist:
    """A cumulative histogram being summed: bounds of the first one added."""

    __slots__ = ("bounds", "count", "cum", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.cum = [0] * len(bounds)
        self.count = 0
        self.sum = 0.0

    def add(self, bounds: tuple[float, ...], cum: list[int], count: int, total: float) -> None:
        if bounds != self.bounds:  # another version's buckets: made cumulative, then floored
            cum = _rebucket(bounds, list(accumulate(cum, max)), self.bounds)
        self.cum = list(map(add, self.cum, cum))
        self.count += count
        self.sum += total


def _rebucket(bounds: tuple[float, ...], cum: list[int], onto: tuple[float, ...]) -> list[int]:
    """Cumulative counts at `onto`'s bounds: the count at the largest own bound <= each (a floor)."""
    out, j, last = [], 0, 0
    for b in onto:
        while j < len(bounds) and bounds[j] <= b:
            last = cum[j]
            j += 1
        out.append(last)
    return out


def cumulative(h: Histogram) -> tuple[list[int], int]:
    """(bucket counts made non-decreasing, the +Inf count), as the exposition writes them."""
    n = len(h.bounds)
    cum = list(accumulate(h.counts[:n], max, initial=0))[1:]  # never below the bucket before
    last = cum[-1] if cum else 0
    if len(cum) < n:
        cum.extend([last] * (n - len(cum)))
    return cum, max(h.count, last)


class WorkerSums:
    """Counters keyed by (family, worker_id, label value) and histograms by (worker_id, medium)."""

    __slots__ = ("cache", "counters", "hists")

    def __init__(self) -> None:
        self.counters: dict[tuple[str, str, str], float] = {}
        self.hists: dict[tuple[str, str], _Hist] = {}
        self.cache = CacheSums()  # the cache analytics' per-worker sums (export/cache.py)

    def __bool__(self) -> bool:
        return bool(self.counters or self.hists or self.cache)

    def counter(self, name: str, worker_id: str, value_label: str, v: float) -> None:
        """Add one stream's counter value."""
        key = (name, worker_id, value_label)
        self.counters[key] = self.counters.get(key, 0) + v

    def histogram(self, worker_id: str, medium: str, h: Histogram) -> None:
        """Add one stream's lifetime histogram of `medium`."""
        acc = self.hists.get((worker_id, medium))
        if acc is None:
            acc = self.hists[(worker_id, medium)] = _Hist(tuple(h.bounds))
        if len(h.counts) == len(acc.bounds) and acc.bounds == tuple(h.bounds):
            acc.cum = list(map(add, acc.cum, h.counts))  # made cumulative when written
            acc.count += h.count
            acc.sum += h.sum
        else:
            cum, top = cumulative(h)
            acc.add(tuple(h.bounds), cum, top, h.sum)

    def histograms(self, worker_id: str, medium: str, hs: list[Histogram]) -> None:
        """histogram() of each of `hs` in order, at once when they share their bounds."""
        acc = self.hists.get((worker_id, medium))
        if acc is None:
            acc = self.hists[(worker_id, medium)] = _Hist(tuple(hs[0].bounds))
        bounds = list(acc.bounds)
        counts = list(map(_COUNTS, hs))
        same = list(map(_BOUNDS, hs)).count(bounds) == len(hs)
        if same and set(map(len, counts)) == {len(bounds)}:
            acc.cum = list(map(add, acc.cum, map(sum, zip(*counts, strict=True))))
            acc.count += sum(map(_COUNT, hs))
            acc.sum = reduce(add, map(_SUM, hs), acc.sum)  # in order: floats
            return
        for h in hs:
            self.histogram(worker_id, medium, h)

    def merge(self, other: WorkerSums) -> None:
        """Add another collector's sums (in collector order)."""
        counters = self.counters
        for key, v in other.counters.items():
            counters[key] = counters.get(key, 0) + v
        for hkey, h in other.hists.items():
            acc = self.hists.get(hkey)
            if acc is None:
                acc = self.hists[hkey] = _Hist(h.bounds)
            acc.add(h.bounds, h.cum, h.count, h.sum)
        self.cache.merge(other.cache)

    def counter_samples(self) -> list[tuple[str, dict[str, str], float]]:
        """(family, labels, value) of every summed counter, sorted."""
        return [
            (name, {"worker_id": w, COUNTER_LABEL[name]: lv}, v)
            for (name, w, lv), v in sorted(self.counters.items())
        ]

    def histogram_samples(self) -> list[tuple[dict[str, str], Histogram]]:
        """(labels, histogram) of every summed histogram, sorted by worker and medium."""
        out = []
        for (w, m), h in sorted(self.hists.items()):
            cum, top = cumulative(Histogram(list(h.bounds), h.cum, h.count, h.sum))
            out.append(({"worker_id": w, "medium": m}, Histogram(list(h.bounds), cum, top, h.sum)))
        return out
