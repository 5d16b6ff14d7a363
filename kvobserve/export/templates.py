"""A family's lines from templates built for its series' labels: only the values are formatted.

The lines of a family differ from one scrape to the next mostly in their values; which lines
exist and their labels (the family's "shape") rarely change. So each family keeps, per
collector, its lines for the shape they last had with a `%s` per value, and for the batch of
collectors last written together those templates joined; a scrape formats the values (one
`format_value` each, C-level `%`), and a family whose values did not change keeps its text.
Byte for byte what prometheus_client writes for the same series (tests hold the two equal).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from prometheus_client.utils import floatToGoString

from kvobserve.export.exposition import cumulative, format_value, label_text
from kvobserve.export.series import Column
from kvobserve.wire.snapshot import Histogram

_SEP = "\x00"  # between collectors in a batch's text; a label value holding one: cut apart
# collector -> its lines' shape, template, the values it takes, whether the template holds _SEP,
# the last values and their lines
PerCollector = dict[str, tuple[object, str, int, bool, list[Any], bytes]]


class Filled:
    """One family's lines over a batch of collectors: all of them, or each collector's."""

    __slots__ = ("_pieces", "_text", "_whole")

    def __init__(self, text: str | None, pieces: list[bytes] | None = None) -> None:
        self._text = text  # the collectors' lines with _SEP between them
        self._pieces = pieces
        self._whole: bytes | None = None

    @property
    def whole(self) -> bytes:
        """Every collector's lines, in batch order."""
        if self._whole is None:
            if self._pieces is not None:
                self._whole = b"".join(self._pieces)
            else:
                assert self._text is not None
                self._whole = self._text.replace(_SEP, "").encode()
        return self._whole

    @property
    def pieces(self) -> list[bytes]:
        """Each collector's lines (b"" for none)."""
        if self._pieces is None:
            assert self._text is not None
            self._pieces = list(map(str.encode, self._text.split(_SEP)))
            self._text = None  # no longer needed: the whole lines come from the pieces
        return self._pieces


class FamilyText:
    """One family's lines over batches of collectors, from templates kept for their shapes."""

    __slots__ = (
        "_counts",
        "_cut",
        "_joined",
        "_last",
        "_per",
        "_shape",
        "_templates",
        "hist",
        "labelnames",
        "name",
    )

    def __init__(
        self,
        name: str,
        labelnames: tuple[str, ...],
        hist: bool = False,
        per: PerCollector | None = None,
    ) -> None:
        self.name = name
        self.labelnames = labelnames
        self.hist = hist
        # each collector's template and last lines (shared by a family's FamilyTexts)
        self._per: PerCollector = {} if per is None else per
        self._shape: tuple[object, ...] | None = None  # of the last batch
        self._templates: list[str] = []  # its collectors' templates
        self._counts: list[int] = []  # the values each takes
        self._joined: str | None = None  # them with _SEP between, once a batch of that shape came
        self._cut = False  # a label value holds _SEP: a template per collector
        self._last: tuple[list[Any], Filled] | None = None

    def fill(self, col: Column, ids: list[str]) -> Filled:
        """The lines of the batch of collectors `ids` (the Column's owners index them): from
        the batch's template when the batch is the last one's shape (every collector changed
        since the last scrape, the usual case), else collector by collector."""
        values = col.values
        bounds = None
        if self.hist:
            bounds = [(h.bounds, len(h.counts)) for h in values]
            values = _flat(values)
        shape = (ids, col.labels, col.owner, bounds)
        if shape != self._shape:
            filled = self._by_collector(col, ids, values, bounds)
            self._shape = shape
        elif self._last is not None and self._last[0] == values:
            return self._last[1]
        else:
            text = list(map(format_value, values))
            if not self._cut:
                if self._joined is None:
                    self._joined = _SEP.join(self._templates)
                filled = Filled(self._joined % tuple(text))
            else:
                out, start = [], 0
                for tmpl, k in zip(self._templates, self._counts, strict=True):
                    out.append((tmpl % tuple(text[start : start + k])).encode())
                    start += k
                filled = Filled(None, out)
        self._last = (values, filled)
        return filled

    def _by_collector(
        self, col: Column, ids: list[str], values: list[Any], bounds: list[Any] | None
    ) -> Filled:
        """Each collector's lines, from its template (made again where its shape changed; its
        last lines where its values did not)."""
        per = Counter(col.owner)  # each collector's series are consecutive
        templates, counts, pieces = [], [], []
        known = self._per
        cut = False
        b = v = 0
        for j, cid in enumerate(ids):
            a, b = b, b + per[j]
            shape = col.labels[a:b] if bounds is None else (col.labels[a:b], bounds[a:b])
            hit = known.get(cid)
            if hit is not None and hit[0] == shape:
                _, tmpl, k, sep, last, piece = hit
                mine = values[v : v + k]
                if last != mine:
                    piece = (tmpl % tuple(map(format_value, mine))).encode()
                    known[cid] = (shape, tmpl, k, sep, mine, piece)
            else:
                tmpl, k = self._template(col.labels[a:b], col.values[a:b])
                sep = _SEP in tmpl
                mine = values[v : v + k]
                piece = (tmpl % tuple(map(format_value, mine))).encode()
                known[cid] = (shape, tmpl, k, sep, mine, piece)
            cut = cut or sep
            v += k
            templates.append(tmpl)
            counts.append(k)
            pieces.append(piece)
        self._templates, self._counts, self._joined, self._cut = templates, counts, None, cut
        return Filled(None, pieces)

    def _template(self, labels: list[tuple[str, ...]], values: list[Any]) -> tuple[str, int]:
        """One collector's lines with `%s` for the values, and how many values they take."""
        name, names = self.name, self.labelnames
        lines = []
        if not self.hist:
            for lab in labels:
                lines.append(f"{name}{label_text(names, lab).replace('%', '%%')} %s\n")
            return "".join(lines), len(labels)
        le_names = (*names, "le")
        k = 0
        for lab, h in zip(labels, values, strict=True):
            ls = label_text(names, lab).replace("%", "%%")
            for bound in h.bounds[: len(h.counts)]:
                le = label_text(le_names, (*lab, floatToGoString(bound))).replace("%", "%%")
                lines.append(f"{name}_bucket{le} %s\n")
            le = label_text(le_names, (*lab, "+Inf")).replace("%", "%%")
            lines.append(f"{name}_bucket{le} %s\n{name}_count{ls} %s\n{name}_sum{ls} %s\n")
            k += min(len(h.bounds), len(h.counts)) + 3
        return "".join(lines), k


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
