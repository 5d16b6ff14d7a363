"""Per-worker sums of values read per stream (the default series budget, docs/metrics.md).

Each collector's streams are summed into one `Sums`; a scrape merges them in collector order, so
the cached text and prometheus_client's collector add the same floats in the same order.
"""

from __future__ import annotations

from itertools import accumulate
from operator import add, attrgetter
from typing import Any

from kvobserve.wire.snapshot import Histogram

Labels = tuple[str, ...]
_BOUNDS, _COUNTS = attrgetter("bounds"), attrgetter("counts")
_COUNT, _SUM = attrgetter("count"), attrgetter("sum")


class _Hist:
    """A cumulative histogram being summed: the bounds of the first one added."""

    __slots__ = ("bounds", "count", "cum", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.cum = [0] * len(bounds)
        self.count = 0
        self.sum = 0.0

    def add(self, bounds: list[float], cum: list[int], count: int, total: float) -> None:
        if len(cum) != len(self.bounds) or bounds != self.bounds:
            cum = _onto(bounds, cum, self.bounds)  # another version's buckets: floored
        self.cum = list(map(add, self.cum, cum))
        self.count += count
        self.sum += total

    def histogram(self) -> Histogram:
        """The sum so far (counts not yet made non-decreasing: exposition.cumulative does)."""
        return Histogram(self.bounds, self.cum, self.count, self.sum)


def _onto(bounds: list[float], counts: list[int], onto: list[float]) -> list[int]:
    """Cumulative counts at `onto`'s bounds: the count at the largest own bound <= each."""
    cum = list(accumulate(counts[: len(bounds)], max, initial=0))[1:]
    out, j, last = [], 0, 0
    for b in onto:
        while j < len(cum) and bounds[j] <= b:
            last = cum[j]
            j += 1
        out.append(last)
    return out


class Sums:
    """Values summed by (family, label values): numbers, or histograms (`_Hist`)."""

    __slots__ = ("families",)

    def __init__(self) -> None:
        self.families: dict[str, dict[Labels, Any]] = {}

    def __bool__(self) -> bool:
        return bool(self.families)

    def add(self, name: str, labels: Labels, v: float) -> None:
        """Add one stream's value."""
        got = self.families.get(name)
        if got is None:
            got = self.families[name] = {}
        got[labels] = got.get(labels, 0) + v

    def add_all(self, name: str, labels: Labels, values: list[float]) -> None:
        """Add several streams' values, in order (the floats as add() one by one would)."""
        got = self.families.get(name)
        if got is None:
            got = self.families[name] = {}
        got[labels] = sum(values, got.get(labels, 0))

    def add_histograms(self, name: str, labels: Labels, hs: list[Histogram]) -> None:
        """add_histogram() of each of `hs`, in order; at once when they share the bounds."""
        got = self.families.get(name)
        if got is None:
            got = self.families[name] = {}
        acc = got.get(labels)
        if acc is None:
            acc = got[labels] = _Hist(hs[0].bounds)
        counts = list(map(_COUNTS, hs))
        same = list(map(_BOUNDS, hs)).count(acc.bounds) == len(hs)
        if same and list(map(len, counts)).count(len(acc.bounds)) == len(hs):
            acc.cum = list(map(add, acc.cum, map(sum, zip(*counts, strict=True))))
            acc.count += sum(map(_COUNT, hs))
            acc.sum = sum(map(_SUM, hs), acc.sum)
            return
        for h in hs:
            acc.add(h.bounds, h.counts, h.count, h.sum)

    def add_histogram(self, name: str, labels: Labels, h: Histogram) -> None:
        """Add one stream's histogram."""
        got = self.families.get(name)
        if got is None:
            got = self.families[name] = {}
        acc = got.get(labels)
        if acc is None:
            acc = got[labels] = _Hist(h.bounds)
        acc.add(h.bounds, h.counts, h.count, h.sum)

    def merge(self, other: Sums) -> None:
        """Add another collector's sums (in collector order)."""
        for name, theirs in other.families.items():
            ours = self.families.get(name)
            if ours is None:
                ours = self.families[name] = {}
            if type(next(iter(theirs.values()))) is not _Hist:
                get = ours.get
                for labels, v in theirs.items():
                    ours[labels] = get(labels, 0) + v
                continue
            for labels, h in theirs.items():
                acc = ours.get(labels)
                if acc is None:
                    acc = ours[labels] = _Hist(h.bounds)
                acc.add(h.bounds, h.cum, h.count, h.sum)

    def series(self, name: str) -> tuple[list[Labels], list[Any]]:
        """(label values, value) of a family's sums, sorted; histograms as Histogram."""
        got = self.families.get(name)
        if not got:
            return [], []
        keys = sorted(got)
        values = [got[k] for k in keys]
        if values and type(values[0]) is _Hist:
            values = [h.histogram() for h in values]
        return keys, values
