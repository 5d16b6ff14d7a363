"""A family's lines from a template built for its series' labels: only the values are formatted.

The lines of a family differ from one scrape to the next mostly in their values; which lines
exist and their labels (the family's "shape") rarely change. So each family keeps, for the
shape it last had, its lines with a `%s` per value, and a scrape formats the values (one
`format_value` each, C-level `%`); a family whose values did not change keeps its bytes. The
lines come per collector of the batch (export/scrape.py keeps them until its next snapshot).
Byte for byte what prometheus_client writes for the same series (tests hold the two equal).
"""

from __future__ import annotations

from typing import Any

from prometheus_client.utils import floatToGoString

from kvobserve.export.exposition import cumulative, format_value, label_text
from kvobserve.export.series import Column
from kvobserve.wire.snapshot import Histogram

_SEP = "\x00"  # between collectors in a template; a template whose labels hold one is cut apart


class FamilyText:
    """One family's lines over a batch of collectors, from a template kept for its shape."""

    __slots__ = ("_counts", "_last", "_shape", "_templates", "hist", "labelnames", "name")

    def __init__(self, name: str, labelnames: tuple[str, ...], hist: bool = False) -> None:
        self.name = name
        self.labelnames = labelnames
        self.hist = hist
        self._shape: tuple[object, ...] | None = None
        self._templates: list[str] = []  # one, with _SEP between collectors; else one each
        self._counts: list[int] = []  # values per collector (with one template each)
        self._last: tuple[list[Any], list[bytes]] | None = None

    def pieces(self, col: Column, n: int) -> list[bytes]:
        """Each of the batch's `n` collectors' lines of this family (b"" for none)."""
        values = col.values
        if self.hist:
            shape: tuple[object, ...] = (
                n,
                col.labels,
                col.owner,
                [(h.bounds, len(h.counts)) for h in values],
            )
            values = _flat(values)
        else:
            shape = (n, col.labels, col.owner)
        if shape != self._shape:
            self._build(col, n)
            self._shape = shape
            self._last = None
        elif self._last is not None and self._last[0] == values:
            return self._last[1]
        text = list(map(format_value, values))
        if len(self._templates) == 1:
            out = (self._templates[0] % tuple(text)).split(_SEP)
        else:
            out, start = [], 0
            for tmpl, k in zip(self._templates, self._counts, strict=True):
                out.append(tmpl % tuple(text[start : start + k]))
                start += k
        pieces = list(map(str.encode, out))
        self._last = (values, pieces)
        return pieces

    def _build(self, col: Column, n: int) -> None:
        """The template of each collector's lines."""
        parts: list[list[str]] = [[] for _ in range(n)]
        counts = [0] * n
        name, names = self.name, self.labelnames
        if self.hist:
            le_names = (*names, "le")
            for labels, h, o in zip(col.labels, col.values, col.owner, strict=True):
                ls = label_text(names, labels).replace("%", "%%")
                for bound in h.bounds[: len(h.counts)]:
                    le = label_text(le_names, (*labels, floatToGoString(bound))).replace("%", "%%")
                    parts[o].append(f"{name}_bucket{le} %s\n")
                le = label_text(le_names, (*labels, "+Inf")).replace("%", "%%")
                parts[o].append(f"{name}_bucket{le} %s\n{name}_count{ls} %s\n{name}_sum{ls} %s\n")
                counts[o] += min(len(h.bounds), len(h.counts)) + 3
        else:
            for labels, o in zip(col.labels, col.owner, strict=True):
                ls = label_text(names, labels).replace("%", "%%")
                parts[o].append(f"{name}{ls} %s\n")
                counts[o] += 1
        texts = ["".join(p) for p in parts]
        if any(_SEP in t for t in texts):
            self._templates, self._counts = texts, counts
        else:
            self._templates, self._counts = [_SEP.join(texts)], [sum(counts)]


def _flat(hs: list[Histogram]) -> list[Any]:
    """The values of histograms' lines: buckets, +Inf, count, sum of each."""
    out: list[Any] = []
    for h in hs:
        cum, top = cumulative(h)
        out.extend(cum)
        out.append(top)
        out.append(top)
        out.append(h.sum)
    return out
