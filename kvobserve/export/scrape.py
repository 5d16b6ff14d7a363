"""/metrics from per-collector text kept until the collector's next snapshot, plain or gzip.

What is cached: per collector, its sample lines per family (export/chunks.py), its per-worker
sums, and (once a gzip scrape asked) each family's lines as a deflate segment. The cache key is
everything a chunk depends on: the snapshot object (FleetState replaces it, never mutates it),
whether the collector is up (stale streams drop their gauges), every stream's capacity and the
scheduler entries of its ranks (both joined per rank from whichever collector read them).
Rebuilt per scrape: build info, ownership, snapshot ages (wall clock), the per-worker sums,
extras and passthrough families.

A family's samples come from many collectors, and the text format wants one block per family,
so the body is, per family in catalog order, its header and then each collector's lines in
collector order. For gzip, each piece is compressed on its own with a full flush (no reference
to earlier bytes, ends on a byte boundary), so cached segments can be laid end to end as one
deflate stream in one gzip member; the CRC-32 is computed over the plain pieces.

A label clash (two collectors claiming one stream) is rare: those collectors are rendered again
by the reference writer with one shared seen-set, so the first live copy still wins.
"""

from __future__ import annotations

import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client.metrics_core import Metric

from kvobserve.analysis.views import CollectorView, FleetView
from kvobserve.export import chunks
from kvobserve.export.catalog import CATALOG
from kvobserve.export.chunks import Chunk
from kvobserve.export.exposition import Listed, TextFamilies, header
from kvobserve.export.prometheus import rest_families
from kvobserve.export.rollup import WorkerSums
from kvobserve.export.samples import Detail, Group, collector, groups, ordered

GZIP_LEVEL = 1  # per-piece segments of ~1 kB: higher levels gain little and cost 2-3x the CPU
_GZ_HEAD = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # deflate, no name, no mtime, OS unknown
_GZ_END = b"\x03\x00"  # an empty final block (fixed Huffman)
_EMPTY = Group()
_NAMES = [m.name for m in CATALOG]
_FAMILY = {m.name: m.family for m in CATALOG}


class _Deflate:
    """Independent deflate segments from one compressor (a full flush after each piece)."""

    def __init__(self, level: int) -> None:
        self._c = zlib.compressobj(level, zlib.DEFLATED, -15)

    def __call__(self, data: bytes) -> bytes:
        return self._c.compress(data) + self._c.flush(zlib.Z_FULL_FLUSH)


class ScrapeCache:
    """Renders /metrics bodies from cached per-collector chunks; one render at a time."""

    def __init__(
        self, detail: Detail | None = None, gzip_level: int = GZIP_LEVEL, templates: bool = True
    ) -> None:
        self.detail = detail or Detail()
        self.gzip_level = gzip_level
        self.templates = templates  # False: every changed collector written line by line
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[object, tuple[Any, ...], Chunk]] = {}
        self._headers: dict[tuple[str, bool], tuple[bytes, bytes]] = {}
        self._templates: chunks.Templates = {}  # per collector: its lines' template (by shape)
        self.rendered = 0  # chunks rendered since start (reused ones are not counted)

    def render(
        self,
        view: FleetView,
        extra: Sequence[Metric],
        encoder: Callable[[Any], bytes],
        openmetrics: bool = False,
        gzip: bool = False,
    ) -> bytes:
        """The body for `view` (gzip-compressed when asked): same bytes as render_exposition."""
        with self._lock:
            order = ordered(view)
            before = self.rendered
            cs = self._chunks(view, order)
            # Many collectors changed (a scrape every 15 s sees every busy one changed): one
            # segment per family costs half of one per collector and family. Few changed (HA
            # pairs, short intervals): keep a segment per collector and family, reuse the rest.
            per_piece = (self.rendered - before) * 4 <= len(cs)
            sums = WorkerSums()
            for ch in cs:
                sums.merge(ch.sums)
            level = chunks.fleet_level(view, order, sums, self.detail.shard, self.detail.counters)
            taken: set[str] = set()
            deflate = _Deflate(self.gzip_level) if gzip else None
            if deflate is None or not per_piece:  # whole families: no segment per collector
                body = self._families(cs, level, taken, openmetrics, deflate is not None)
                rest = encoder(Listed(rest_families(view, extra, taken)))
                if deflate is None:
                    return b"".join([*body, rest])
                return _gzip([(b, None) for b in (*body, rest) if b], deflate)
            pieces: list[tuple[bytes, bytes | None]] = []  # (plain, cached segment or None)
            for name in _NAMES:
                own = level.get(name)
                parts: list[tuple[bytes, bytes | None]] = [(own, None)] if own else []
                for ch in cs:
                    text = ch.text.get(name)
                    if text is not None:
                        seg = ch.gz.get(name) if gzip else None
                        if seg is None and deflate is not None and per_piece:
                            seg = ch.gz[name] = deflate(text)
                        parts.append((text, seg))
                if not parts:
                    continue
                if deflate is not None and not per_piece:
                    parts = [(b"".join([p for p, _ in parts]), None)]
                taken.add(_FAMILY[name])
                pieces.append(self._header(name, openmetrics))
                pieces.extend(parts)
            rest = encoder(Listed(rest_families(view, extra, taken)))
            if rest:
                pieces.append((rest, None))
            if deflate is None:
                return b"".join(p for p, _ in pieces)
            return _gzip(pieces, deflate)

    def _families(
        self, cs: list[Chunk], level: dict[str, bytes], taken: set[str], om: bool, joined: bool
    ) -> list[bytes]:
        """Each family's header and lines, collector by collector (one piece per family when
        `joined`); the families served go into `taken`."""
        by: dict[str, list[bytes]] = {name: [text] for name, text in level.items() if text}
        for ch in cs:
            for name, text in ch.text.items():
                got = by.get(name)
                if got is None:
                    by[name] = [text]
                else:
                    got.append(text)
        out = []
        for name in _NAMES:
            texts = by.get(name)
            if not texts:
                continue
            taken.add(_FAMILY[name])
            out.append(self._header(name, om)[0])
            if joined:
                out.append(b"".join(texts))
            else:
                out.extend(texts)
        return out

    def _header(self, name: str, om: bool) -> tuple[bytes, bytes | None]:
        hit = self._headers.get((name, om))
        if hit is None:
            text = header(name, om).encode()
            hit = self._headers[(name, om)] = (text, _Deflate(self.gzip_level)(text))
        return hit

    def _chunks(self, view: FleetView, order: list[CollectorView]) -> list[Chunk]:
        """Each collector's chunk, in order: reused when its key is unchanged."""
        by_c = groups(view)
        fresh: dict[str, tuple[object, tuple[Any, ...], Chunk]] = {}
        out: list[Chunk] = []
        for c in order:
            cid = c.info.collector_id
            g = by_c.get(cid, _EMPTY)
            # scheduler entries are joined per rank across collectors (analysis/fleet.py)
            key = (c.up, tuple([s.capacity_tokens for s in g.streams]), tuple(g.scheduler))
            hit = self._cache.get(cid)
            if hit is not None and hit[0] is c.snapshot and hit[1] == key:
                ch = hit[2]
            else:
                fast = chunks.render(c, g, self.detail, self._templates if self.templates else None)
                ch = fast or self._reference([(c, g)])[0]
                self.rendered += 1
            fresh[cid] = (c.snapshot, key, ch)
            out.append(ch)
        self._cache = fresh  # a forgotten collector leaves the cache with its snapshot
        if len(self._templates) > len(fresh):
            self._templates = {k: v for k, v in self._templates.items() if k in fresh}
        clashing = _clashes(out)
        if clashing:
            cgs = [(order[i], by_c.get(order[i].info.collector_id, _EMPTY)) for i in clashing]
            for i, ch in zip(clashing, self._reference(cgs), strict=True):
                out[i] = ch
        return out

    def _reference(self, cgs: list[tuple[CollectorView, Group]]) -> list[Chunk]:
        """Chunks written by the reference writer, sharing one seen-set (first copy wins)."""
        seen: set[tuple[object, ...]] = set()
        out = []
        for c, g in cgs:
            tf = TextFamilies(seen)
            part = WorkerSums()
            collector(tf, c, g, part, self.detail)
            out.append(Chunk(tf.chunks(), part, chunks.claims(c, g)[0]))
        return out


def _clashes(cs: list[Chunk]) -> list[int]:
    """Indexes of the chunks that share a claimed label set with another, in order."""
    every: set[tuple[str, ...]] = set()
    for ch in cs:
        if not every.isdisjoint(ch.claims):
            break
        every |= ch.claims
    else:
        return []  # the usual case: no two collectors claim one stream
    owner: dict[tuple[str, ...], int] = {}
    involved: set[int] = set()
    for i, ch in enumerate(cs):
        for claim in ch.claims:
            first = owner.setdefault(claim, i)
            if first != i:
                involved.update((first, i))
    return sorted(involved)


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
