"""Writers of the Prometheus text exposition: prometheus_client Metric objects, or text directly.

`TextFamilies` writes the same bytes prometheus_client's encoders write for the catalog's
families, several times faster (docs/performance.md); `MetricFamilies` builds Metric objects for
registries, OTLP and anything else that wants them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Protocol

from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from kvobserve.export.catalog import BY_NAME, CATALOG
from kvobserve.wire.snapshot import Histogram


class MetricFamilies:
    """The catalog's families for one scrape; drops a repeated label set (first one wins)."""

    def __init__(self) -> None:
        self.metrics = {m.name: Metric(m.family, m.help, m.type) for m in CATALOG}
        self._seen: set[tuple[object, ...]] = set()

    def fresh(self, key: tuple[object, ...]) -> bool:
        """True the first time `key` (a series folded into a per-worker sum) is seen."""
        if key in self._seen:
            return False
        self._seen.add(key)
        return True

    def add(self, name: str, labels: dict[str, str], value: float) -> None:
        """One sample of a catalog family; counters get their _total suffix here."""
        m = self.metrics[name]
        key = (name, tuple(labels.values()))
        if key in self._seen:
            # Two collectors claiming one node_rank would otherwise emit duplicate series.
            return
        self._seen.add(key)
        m.add_sample(name, labels, value)

    def histogram(self, name: str, labels: dict[str, str], h: Histogram) -> None:
        """A cumulative histogram as _bucket/_count/_sum samples."""
        key = (name, tuple(labels.values()))
        if key in self._seen:
            return
        self._seen.add(key)
        m = self.metrics[name]
        last = 0
        for bound, count in zip(h.bounds, h.counts, strict=False):
            last = max(last, count)  # cumulative: never let a bucket fall below the one before
            m.add_sample(f"{name}_bucket", {**labels, "le": floatToGoString(bound)}, last)
        m.add_sample(f"{name}_bucket", {**labels, "le": "+Inf"}, max(h.count, last))
        m.add_sample(f"{name}_count", labels, max(h.count, last))
        m.add_sample(f"{name}_sum", labels, h.sum)


class Sink(Protocol):
    """Where `_fleet` puts samples: prometheus_client Metric objects or exposition text."""

    def add(self, name: str, labels: dict[str, str], value: float) -> None: ...

    def histogram(self, name: str, labels: dict[str, str], h: Histogram) -> None: ...

    def fresh(self, key: tuple[object, ...]) -> bool: ...


_SPECIAL = re.compile(r'[\\\n"]')


def _escape(value: str) -> str:
    if _SPECIAL.search(value) is None:
        return value
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


_LABELSTR_MEMO: dict[tuple[tuple[str, str], ...], str] = {}
_LABELSTR_MEMO_MAX = 200_000  # a fleet's label sets are stable across scrapes; bound it anyway


def _labelstr(labels: Mapping[str, str]) -> str:
    """`{k="v",...}` sorted by name, escaped as prometheus_client does; "" for no labels."""
    if not labels:
        return ""
    key = tuple(labels.items())
    text = _LABELSTR_MEMO.get(key)
    if text is None:
        text = "{" + ",".join([f'{k}="{_escape(v)}"' for k, v in sorted(key)]) + "}"
        if len(_LABELSTR_MEMO) >= _LABELSTR_MEMO_MAX:
            _LABELSTR_MEMO.clear()
        _LABELSTR_MEMO[key] = text
    return text


def format_value(v: float) -> str:
    """A sample value exactly as floatToGoString writes it."""
    # floatToGoString(int) is repr(float(v)) below a million: skip the float round trip
    t = type(v)
    if t is int:
        if -1_000_000 < v < 1_000_000:
            return f"{v}.0"
        if 1_000_000 <= v < 2**53:  # exact as a float: repr(float(v)) is str(v) + ".0"
            s = str(v)
            return f"{s[0]}.{s[1:]}0".rstrip("0.") + f"e+{len(s) - 1:02d}"
    elif t is float:
        if -1_000_000.0 < v < 1_000_000.0:
            return repr(v)  # Go's exponent form only starts at a million (NaN fails the test)
        if 1_000_000.0 <= v < 1e16:  # the form floatToGoString gives, without its calls
            s = repr(v)
            dot = s.find(".")
            return f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.") + f"e+{dot - 1:02d}"
    return floatToGoString(v)


_LE = "\x00le\x00"  # placeholder for the `le` value while a histogram's label string is built


class TextFamilies:
    """The catalog's families as exposition text, byte for byte what prometheus_client writes.

    prometheus_client builds a Sample and a label dict per sample and sorts and escapes the
    labels per sample; at 1,024 streams (~50k samples) that is about a second per scrape.
    Here a label dict shared by several families is rendered once (cached by identity for
    the scrape) and a histogram's labels once for all its buckets.
    """

    def __init__(self, seen: set[tuple[object, ...]] | None = None) -> None:
        self.lines: dict[str, list[str]] = {m.name: [] for m in CATALOG}
        # shared by the collectors of a label clash, so the first copy wins across them
        self._seen: set[tuple[object, ...]] = set() if seen is None else seen
        self._cache: dict[int, tuple[Mapping[str, str], str]] = {}  # keeps the dicts alive
        self._le: dict[float, str] = {}

    def fresh(self, key: tuple[object, ...]) -> bool:
        """True the first time `key` (a series folded into a per-worker sum) is seen."""
        if key in self._seen:
            return False
        self._seen.add(key)
        return True

    def _labels(self, labels: Mapping[str, str]) -> str:
        hit = self._cache.get(id(labels))
        if hit is not None and hit[0] is labels:
            return hit[1]
        text = _labelstr(labels)
        self._cache[id(labels)] = (labels, text)
        return text

    def add(self, name: str, labels: dict[str, str], value: float) -> None:
        """One sample of a catalog family; a repeated label set is dropped (first one wins)."""
        hit = self._cache.get(id(labels))
        ls = hit[1] if hit is not None and hit[0] is labels else self._labels(labels)
        key = (name, ls)
        seen = self._seen
        if key in seen:
            return
        seen.add(key)
        # format_value() inlined: this runs once per sample
        if type(value) is int and -1_000_000 < value < 1_000_000:
            self.lines[name].append(f"{name}{ls} {value}.0\n")
        else:
            self.lines[name].append(f"{name}{ls} {floatToGoString(value)}\n")

    def histogram(self, name: str, labels: dict[str, str], h: Histogram) -> None:
        """A cumulative histogram as _bucket/_count/_sum lines."""
        ls = self._labels(labels)
        key = (name, ls)
        if key in self._seen:
            return
        self._seen.add(key)
        parts = _labelstr({**labels, "le": _LE}).split(_LE)
        if len(parts) != 2:  # the placeholder inside a label value: do it the long way
            f = MetricFamilies()
            f.histogram(name, labels, h)
            self.lines[name].extend(_sample_line(s) for s in f.metrics[name].samples)
            return
        head, tail = f"{name}_bucket{parts[0]}", f"{parts[1]} "
        out = self.lines[name]
        le = self._le
        last = 0
        for bound, count in zip(h.bounds, h.counts, strict=False):
            last = max(last, count)  # cumulative: never let a bucket fall below the one before
            b = le.get(bound)
            if b is None:
                b = le[bound] = floatToGoString(bound)
            out.append(f"{head}{b}{tail}{format_value(last)}\n")
        top = format_value(max(h.count, last))
        out.append(f"{head}+Inf{tail}{top}\n")
        out.append(f"{name}_count{ls} {top}\n")
        out.append(f"{name}_sum{ls} {format_value(h.sum)}\n")

    def chunks(self) -> dict[str, bytes]:
        """The sample lines of each family that has any, as bytes."""
        return {name: "".join(lines).encode() for name, lines in self.lines.items() if lines}

    def text(self, openmetrics: bool) -> tuple[str, set[str]]:
        """(the families with samples as text, their prometheus_client family names)."""
        out: list[str] = []
        names: set[str] = set()
        for m in CATALOG:
            lines = self.lines[m.name]
            if not lines:
                continue
            names.add(m.family)
            out.append(header(m.name, openmetrics))
            out.extend(lines)
        return "".join(out), names


def header(name: str, openmetrics: bool) -> str:
    """A family's `# HELP` and `# TYPE` lines as prometheus_client writes them."""
    m = BY_NAME[name]
    if openmetrics:
        doc = m.help.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
        return f"# HELP {m.family} {doc}\n# TYPE {m.family} {m.type}\n"
    doc = m.help.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {m.name} {doc}\n# TYPE {m.name} {m.type}\n"


def _sample_line(s: Sample) -> str:
    return f"{s.name}{_labelstr(s.labels)} {floatToGoString(s.value)}\n"


class Listed:
    """Metric families already built, in the shape an encoder wants (a `collect()`)."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> list[Metric]:
        """The families."""
        return self._metrics
