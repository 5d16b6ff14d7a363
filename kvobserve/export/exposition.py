"""The Prometheus text exposition as prometheus_client writes it: label text, values, headers.

export/templates.py writes /metrics with these; tests hold the bytes to prometheus_client's own
encoders (`generate_latest`, OpenMetrics' `generate_latest`) over export/prometheus.py's collector.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from itertools import accumulate

from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from kvobserve.export.catalog import BY_NAME
from kvobserve.wire.snapshot import Histogram

_SPECIAL = re.compile(r'[\\\n"]')


def escape(value: str) -> str:
    """A label value escaped as the text format wants it (backslash, newline, double quote)."""
    if _SPECIAL.search(value) is None:
        return value
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def label_text(names: Sequence[str], values: Sequence[str]) -> str:
    """`{k="v",...}` sorted by name, escaped as prometheus_client does; "" for no labels."""
    if not names:
        return ""
    pairs = sorted(zip(names, values, strict=True))
    return "{" + ",".join([f'{k}="{escape(v)}"' for k, v in pairs]) + "}"


_EXP = [f"e+{k:02d}" for k in range(17)]  # Go's exponent, by the digits before the point - 1


def format_value(v: float) -> str:
    """A sample value exactly as floatToGoString writes it."""
    # floatToGoString(int) is repr(float(v)) below a million: skip the float round trip
    t = type(v)
    if t is int:
        if -1_000_000 < v < 1_000_000:
            return f"{v}.0"
        if 1_000_000 <= v < 2**53:  # exact as a float: repr(float(v)) is str(v) + ".0"
            s = str(v)
            return f"{s[0]}.{s[1:]}".rstrip("0.") + _EXP[len(s) - 1]
    elif t is float:
        if -1_000_000.0 < v < 1_000_000.0:
            return repr(v)  # Go's exponent form only starts at a million (NaN fails the test)
        if 1_000_000.0 <= v < 1e16:  # the form floatToGoString gives, without its calls
            s = repr(v)
            dot = s.find(".")
            return f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.") + _EXP[dot - 1]
    return floatToGoString(v)


def cumulative(h: Histogram) -> tuple[list[int], int]:
    """(a bucket count per bound, each at least the one before; the +Inf count, also _count)."""
    cum = list(accumulate(h.counts[: len(h.bounds)], max, initial=0))[1:]
    return cum, max(h.count, cum[-1] if cum else 0)


def header(name: str, openmetrics: bool) -> str:
    """A family's `# HELP` and `# TYPE` lines as prometheus_client writes them."""
    m = BY_NAME[name]
    if openmetrics:
        doc = m.help.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
        return f"# HELP {m.family} {doc}\n# TYPE {m.family} {m.type}\n"
    doc = m.help.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {m.name} {doc}\n# TYPE {m.name} {m.type}\n"


class Listed:
    """Metric families already built, in the shape an encoder wants (a `collect()`)."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> list[Metric]:
        """The families."""
        return self._metrics
