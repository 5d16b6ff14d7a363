"""Per-worker sums of values read per stream (the default series budget, docs/metrics.md).

A worker's value is summed over each collector's streams first, then over the collectors in
order: prometheus_client's collector (export/prometheus.py) adds one stream at a time into a
`Sums` per collector and merges them; the cached text (export/scrape.py) sums a whole row at
once over a `Grouping` of the fleet's items. Both add the same floats in the same order.
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

    def add_all(self, hs: list[Histogram]) -> None:
        """add() each of `hs`, in order; at once when they have its bounds."""
        counts = list(map(_COUNTS, hs))
        n = len(self.bounds)
        if list(map(_BOUNDS, hs)).count(self.bounds) == len(hs) and list(map(len, counts)).count(
            n
        ) == len(hs):
            self.cum = list(map(add, self.cum, map(sum, zip(*counts, strict=True))))
            self.count += sum(map(_COUNT, hs))
            self.sum = sum(map(_SUM, hs), self.sum)
            return
        for h in hs:
            self.add(h.bounds, h.counts, h.count, h.sum)


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


class Grouping:
    """Items in collector order grouped by label set, to sum a row's values over them in C:
    the runs of one collector and label set, and the runs of each label set (sorted)."""

    __slots__ = ("keys", "labels", "order", "owner", "runs", "spans")

    def __init__(self, keys: list[Labels], owner: list[int]) -> None:
        self.keys, self.owner = keys, owner  # what it was made for (compared by the caller)
        n = len(keys)
        order: list[int] | None = sorted(range(n), key=keys.__getitem__)  # stable: by collector
        if order == list(range(n)):
            order = None  # already by label set (one worker per collector, in worker order)
        self.order = order
        ks = keys if order is None else list(map(keys.__getitem__, order))
        os = owner if order is None else list(map(owner.__getitem__, order))
        self.runs: list[slice] = []  # items of one collector and label set
        self.spans: list[slice] = []  # runs of one label set
        self.labels: list[Labels] = []  # each span's label set, sorted
        start = first = 0
        for i in range(1, n + 1):
            if i < n and ks[i] == ks[i - 1] and os[i] == os[i - 1]:
                continue
            self.runs.append(slice(start, i))
            start = i
            if i == n or ks[i] != ks[i - 1]:
                self.spans.append(slice(first, len(self.runs)))
                first = len(self.runs)
                self.labels.append(ks[i - 1])

    def sums(self, values: list[Any]) -> list[Any]:
        """Each label set's sum of `values` (one per item): per collector, then over them."""
        if self.order is not None:
            values = list(map(values.__getitem__, self.order))
        per = list(map(sum, map(values.__getitem__, self.runs)))
        return list(map(sum, map(per.__getitem__, self.spans)))

    def histograms(self, values: list[Histogram]) -> list[Histogram]:
        """Each label set's sum of the histograms `values`, as sums() adds numbers."""
        if self.order is not None:
            values = list(map(values.__getitem__, self.order))
        per = []
        for run in self.runs:
            hs = values[run]
            acc = _Hist(hs[0].bounds)
            acc.add_all(hs)
            per.append(acc)
        out = []
        for span in self.spans:
            accs = per[span]
            acc = _Hist(accs[0].bounds)
            for h in accs:
                acc.add(h.bounds, h.cum, h.count, h.sum)
            out.append(acc.histogram())
        return out
