"""Engine metric families that collectors forward, merged by name for /metrics."""

from __future__ import annotations

import re
from collections.abc import Iterator

from prometheus_client.metrics_core import Metric

from kvobserve.analysis.views import FleetView
from kvobserve.wire.snapshot import Family

_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "gauge": ("",),
    "unknown": ("",),
}


def passthrough(v: FleetView) -> Iterator[Metric]:
    """Live collectors' engine families, merged by name; invalid or clashing ones are dropped."""
    merged: dict[str, Metric] = {}
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for c in v.collectors:
        if not c.up:
            continue
        for fam in c.snapshot.passthrough:
            m = _family(fam, merged)
            if m is None:
                continue
            for smp in fam.samples:
                sname = _promname(smp.name)
                if not sname.startswith(m.name) or sname[len(m.name) :] not in _SUFFIXES[m.type]:
                    continue
                if not all(_LABEL_RE.match(k) for k in smp.labels):
                    continue
                key = (sname, tuple(sorted(smp.labels.items())))
                if key not in seen:
                    seen.add(key)
                    m.add_sample(sname, dict(smp.labels), smp.value)
    yield from (m for m in merged.values() if m.samples)


def _promname(name: str) -> str:
    # Colons are reserved for recording rules (promtool lint): sglang:num_running_reqs is
    # served as sglang_num_running_reqs.
    return name.replace(":", "_")


def _family(fam: Family, merged: dict[str, Metric]) -> Metric | None:
    typ = fam.type if fam.type in ("counter", "gauge", "histogram", "summary") else "unknown"
    name = _promname(fam.name)
    if typ == "counter" and name.endswith("_total"):
        name = name[: -len("_total")]
    if not _NAME_RE.match(name) or name.startswith("kvobserve_"):
        return None  # kvobserve_* is ours: an engine must not shadow the catalog
    m = merged.get(name)
    if m is None:
        m = merged[name] = Metric(name, fam.help or name, typ)
    return m if m.type == typ else None
