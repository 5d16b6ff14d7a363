"""/metrics from each family's text, kept while its values are the same, plain or gzip.

Every render reads the whole fleet, row by row (export/series.py: a row's values for every
stream at once), and writes each family's lines from its template (export/templates.py): the
values are compared with the last render's, and a family whose values did not change (most
gauges) keeps its text, and for gzip its deflate segment. The fleet's label sets are kept from
one render to the next (so that a template's shape is checked by identity), as are the groupings
of the per-worker sums. Rebuilt per scrape, as everything else: build info, ownership, snapshot
ages (wall clock), extras and passthrough families.

The body is, per family in catalog order, its header and its lines: the fleet-level ones (the
per-worker sums, ownership, ...), then those of the collectors' items in collector order. For
gzip, each family is compressed on its own with a full flush (no reference to earlier bytes,
ends on a byte boundary), so kept segments can be laid end to end as one deflate stream in one
gzip member; the CRC-32 is computed over the plain pieces.

A label clash (two collectors claiming one stream, or a collector repeating its own) is rare:
that render reads every series with a seen-set (the first live copy wins), as the reference.
"""

from __future__ import annotations

import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client.metrics_core import Metric

from kvobserve.analysis.views import FleetView
from kvobserve.export.catalog import BY_NAME, CATALOG
from kvobserve.export.exposition import Listed, header
from kvobserve.export.prometheus import rest_families
from kvobserve.export.series import EMPTY, Detail, Memo, Plan, groups, ordered
from kvobserve.export.templates import FamilyText

GZIP_LEVEL = 1  # per-family segments: higher levels gain little and cost 2-3x the CPU
_GZ_HEAD = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # deflate, no name, no mtime, OS unknown
_GZ_END = b"\x03\x00"  # an empty final block (fixed Huffman)
_NAMES = [m.name for m in CATALOG]
_FAMILY = {m.name: m.family for m in CATALOG}


class _Deflate:
    """Independent deflate segments from one compressor (a full flush after each piece)."""

    def __init__(self, level: int) -> None:
        self._c = zlib.compressobj(level, zlib.DEFLATED, -15)

    def __call__(self, data: bytes) -> bytes:
        return self._c.compress(data) + self._c.flush(zlib.Z_FULL_FLUSH)


class ScrapeCache:
    """Renders /metrics bodies from each family's text, kept while it holds; one at a time."""

    def __init__(self, detail: Detail | None = None, gzip_level: int = GZIP_LEVEL) -> None:
        self.detail = detail or Detail()
        self.gzip_level = gzip_level
        self._plan = Plan(self.detail)
        self._lock = threading.Lock()
        self._memo = Memo()  # what the last read of the fleet left (label sets, groupings)
        self._texts: dict[str, FamilyText] = {}  # per family: the collectors' items' lines
        self._level: dict[str, FamilyText] = {}  # per family: the fleet-level lines
        self._headers: dict[tuple[str, bool], tuple[bytes, bytes]] = {}
        # family -> (its pieces, joined, deflate segment) at the last gzip render
        self._joined: dict[str, tuple[list[bytes], bytes, bytes]] = {}
        self.written = 0  # family texts formatted since start (kept ones are not counted)

    def render(
        self,
        view: FleetView,
        extra: Sequence[Metric],
        encoder: Callable[[Any], bytes],
        openmetrics: bool = False,
        gzip: bool = False,
    ) -> bytes:
        """The body for `view` (gzip-compressed when asked): the bytes prometheus_client's
        `encoder` writes over export/prometheus.py's FleetCollector."""
        with self._lock:
            order = ordered(view)
            by_c = groups(view)
            batch = self._plan.batch(
                [(c, by_c.get(c.info.collector_id, EMPTY)) for c in order], memo=self._memo
            )
            by: dict[str, list[bytes]] = {}
            for kept, columns in (
                (self._level, self._plan.fleet(view, order, batch.summed)),
                (self._texts, batch.columns),
            ):
                for name, col in columns.items():
                    family = kept.get(name)
                    if family is None:
                        family = kept[name] = FamilyText(
                            name, self._plan.names[name], BY_NAME[name].type == "histogram"
                        )
                    before = family.text
                    by.setdefault(name, []).append(family.fill(col))
                    self.written += family.text is not before
            taken: set[str] = set()
            deflate = _Deflate(self.gzip_level) if gzip else None
            body = self._families(by, taken, openmetrics, deflate)
            rest = encoder(Listed(rest_families(view, extra, taken)))
            if deflate is None:
                return b"".join([*(p for p, _ in body), rest])
            return _gzip([*body, (rest, None)] if rest else body, deflate)

    def _families(
        self, by: dict[str, list[bytes]], taken: set[str], om: bool, deflate: _Deflate | None
    ) -> list[tuple[bytes, bytes | None]]:
        """Each family's header and lines (`by` family), with `deflate` as one piece per family
        and its deflate segment, kept while its lines are the same (the families whose values
        did not change, most gauges); the families served go into `taken`."""
        out: list[tuple[bytes, bytes | None]] = []
        kept = {}
        for name in _NAMES:
            texts = by.get(name)
            if not texts:
                continue
            taken.add(_FAMILY[name])
            head = self._header(name, om)
            if deflate is None:
                out.append((head[0], None))
                out.extend((t, None) for t in texts if t)
                continue
            out.append(head)
            last = self._joined.get(name)
            if last is None or last[0] != texts:
                joined = b"".join(texts)
                last = (texts, joined, deflate(joined))
            kept[name] = last
            out.append(last[1:])
        if deflate is not None:
            self._joined = kept
        return out

    def _header(self, name: str, om: bool) -> tuple[bytes, bytes]:
        hit = self._headers.get((name, om))
        if hit is None:
            text = header(name, om).encode()
            hit = self._headers[(name, om)] = (text, _Deflate(self.gzip_level)(text))
        return hit


def _gzip(pieces: list[tuple[bytes, bytes | None]], deflate: _Deflate) -> bytes:
    """One gzip member: the segments end to end, an empty final block, CRC-32 and length."""
    crc, size, out = 0, 0, [_GZ_HEAD]
    for plain, seg in pieces:
        crc = zlib.crc32(plain, crc)
        size += len(plain)
        out.append(seg if seg is not None else deflate(plain))
    out.append(_GZ_END)
    out.append(struct.pack("<II", crc, size & 0xFFFFFFFF))
    return b"".join(out)
