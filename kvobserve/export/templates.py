"""A family's lines from a template built for its series' labels: only the values are formatted.

The lines of a family differ from one scrape to the next mostly in their values; which lines
exist and their labels (the family's "shape") rarely change. So each family keeps its lines for
the shape they last had with a `%s` per value; a scrape formats the values (one `format_value`
each, C-level `%`), and a family whose values did not change keeps its text. When the shape
changes (a stream appears, goes stale), the lines of the label sets it had before are reused.
Byte for byte what prometheus_client writes for the same series (tests hold the two equal).
"""

from __future__ import annotations

from typing import Any

from prometheus_client.utils import floatToGoString

from kvobserve.export.exposition import cumulative, format_value, label_text
from kvobserve.export.series import Column
from kvobserve.export.sums import Labels
from kvobserve.wire.snapshot import Histogram


class FamilyText:
    """One family's lines, from a template kept for their shape."""

    __slots__ = (
        "_bounds",
        "_labels",
        "_template",
        "_text",
        "_values",
        "hist",
        "labelnames",
        "name",
    )

    def __init__(self, name: str, labelnames: tuple[str, ...], hist: bool = False) -> None:
        self.name = name
        self.labelnames = labelnames
        self.hist = hist
        self._labels: list[Labels] | None = None  # the shape: label sets (and bounds) of
        self._bounds: list[tuple[list[float], int]] | None = None  # histograms
        self._template = ""
        self._values: list[Any] | None = None  # the last values, and their text
        self._text = b""

    @property
    def text(self) -> bytes:
        """The lines last filled in."""
        return self._text

    def fill(self, col: Column) -> bytes:
        """The lines of `col`'s series."""
        values = col.values
        labels = col.labels
        bounds = None
        if self.hist:
            bounds = [(h.bounds, len(h.counts)) for h in values]
            values = _flat(values)
        if bounds != self._bounds or (labels is not self._labels and labels != self._labels):
            self._template = self._make(labels, col.values, bounds)
            self._values = None
        elif values == self._values:
            self._labels = labels  # the same label sets: compared by identity next time
            return self._text
        self._labels, self._bounds = labels, bounds
        self._text = (self._template % tuple(map(format_value, values))).encode()
        self._values = values
        return self._text

    def _make(self, labels: list[Labels], values: list[Any], bounds: list[Any] | None) -> str:
        """The template of these series: the lines of label sets served before reused."""
        name, names = self.name, self.labelnames
        if bounds is not None:  # histograms: the lines of each, made afresh (few series)
            return "".join(self._histogram(lab, h) for lab, h in zip(labels, values, strict=True))
        had: dict[Labels, str] = {}
        if self._labels and not self.hist:
            had = dict(zip(self._labels, self._template.split("\n"), strict=False))
        lines = list(map(had.get, labels))
        for i, line in enumerate(lines):
            if line is None:
                lines[i] = f"{name}{label_text(names, labels[i]).replace('%', '%%')} %s"
        return "\n".join(lines) + "\n" if lines else ""  # type: ignore[arg-type]

    def _histogram(self, labels: Labels, h: Histogram) -> str:
        """One histogram's lines: buckets, +Inf, count and sum."""
        name = self.name
        le_names = (*self.labelnames, "le")
        ls = label_text(self.labelnames, labels).replace("%", "%%")
        out = []
        for bound in h.bounds[: len(h.counts)]:
            le = label_text(le_names, (*labels, floatToGoString(bound))).replace("%", "%%")
            out.append(f"{name}_bucket{le} %s\n")
        le = label_text(le_names, (*labels, "+Inf")).replace("%", "%%")
        out.append(f"{name}_bucket{le} %s\n{name}_count{ls} %s\n{name}_sum{ls} %s\n")
        return "".join(out)


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
