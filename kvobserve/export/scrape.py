"""/metrics from per-collector text kept until the collector's next snapshot, plain or gzip.

What is cached: per collector, its sample lines per family, its per-worker sums, and (once a
gzip scrape asked) each family's lines as a deflate segment. The collectors whose chunk must be
rendered again are read in blocks of BLOCK (export/series.py: row by row over a block, whose
items then stay in the CPU's cache) and their lines written from each family's templates
(export/templates.py). When every collector was read again (a one-off scrape, or one every
15 s), each family's lines are laid out whole, not collector by collector. The cache key is
everything a chunk depends on: the snapshot (by its serial, not the object: FleetState replaces
snapshots, never mutates them, and a replaced one is freed by the intake, not by the next
render), whether the collector is up (stale streams drop their gauges), every stream's capacity
and the scheduler entries of its ranks (both joined per rank from whichever collector read them).
Rebuilt per scrape: build info, ownership, snapshot ages (wall clock), the per-worker sums,
extras and passthrough families.

A family's samples come from many collectors, and the text format wants one block per family,
so the body is, per family in catalog order, its header and then each collector's lines in
collector order. For gzip, each piece is compressed on its own with a full flush (no reference
to earlier bytes, ends on a byte boundary), so cached segments can be laid end to end as one
deflate stream in one gzip member; the CRC-32 is computed over the plain pieces.

A label clash (two collectors claiming one stream, or a collector repeating its own) is rare:
those collectors are read again with one shared seen-set, so the first live copy still wins.
"""

from __future__ import annotations

import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client.metrics_core import Metric

from kvobserve.analysis.views import CollectorView, FleetView
from kvobserve.export.catalog import BY_NAME, CATALOG
from kvobserve.export.exposition import Listed, header
from kvobserve.export.prometheus import rest_families
from kvobserve.export.series import EMPTY, Batch, Detail, Memo, Plan, groups, ordered
from kvobserve.export.sums import Labels, Sums
from kvobserve.export.templates import FamilyText, Filled, PerCollector

BLOCK = 64  # collectors read as one batch (measured: 10-15% less CPU than one of 512 under load)
GZIP_LEVEL = 1  # per-piece segments of ~1 kB: higher levels gain little and cost 2-3x the CPU
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


class Chunk:
    """A collector's lines per family (cut out of its batch's when first asked for), its
    per-worker sums and the label sets it claims."""

    __slots__ = ("_at", "_lines", "_text", "claims", "clean", "gz", "sums")

    def __init__(
        self,
        lines: list[tuple[str, Filled]],
        at: int,
        sums: Sums,
        claims: frozenset[Labels],
        clean: bool = True,
    ) -> None:
        self._lines = lines  # its batch's lines per family; `at` its index in that batch
        self._at = at
        self._text: dict[str, bytes] | None = None
        self.sums = sums
        self.claims = claims
        self.clean = clean  # False: its own label sets repeat (read again with a seen-set)
        self.gz: dict[str, bytes] = {}  # family -> deflate segment, when asked

    @property
    def text(self) -> dict[str, bytes]:
        """Its lines per family that has any."""
        if self._text is None:
            at = self._at
            self._text = {n: t for n, f in self._lines if (t := f.pieces[at])}
            self._lines = []
        return self._text


class ScrapeCache:
    """Renders /metrics bodies from cached per-collector chunks; one render at a time."""

    def __init__(
        self, detail: Detail | None = None, gzip_level: int = GZIP_LEVEL, block: int = BLOCK
    ) -> None:
        self.detail = detail or Detail()
        self.gzip_level = gzip_level
        self.block = block
        self._plan = Plan(self.detail)
        self._lock = threading.Lock()
        # per collector: its snapshot's serial (not the snapshot: a replaced one is freed by the
        # intake, not by a render), the rest of its key and its chunk
        self._cache: dict[str, tuple[int, tuple[Any, ...], Chunk]] = {}
        self._headers: dict[tuple[str, bool], tuple[bytes, bytes]] = {}
        # per block of the changed collectors, the lines of each family
        self._texts: dict[int, dict[str, FamilyText]] = {}
        self._per: dict[str, PerCollector] = {}  # per family: each collector's template
        self._level: dict[str, FamilyText] = {}  # the fleet-level lines, per family
        self._memo: dict[int, Memo] = {}  # per block: the label sets read before (Plan.batch)
        self._seen = Memo()  # each collector's label sets read before
        # family -> (its pieces, joined, deflate segment) at the last gzip render of whole families
        self._joined: dict[str, tuple[list[bytes], bytes, bytes]] = {}
        self.rendered = 0  # chunks rendered since start (reused ones are not counted)

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
            before = self.rendered
            cs, blocks = self._chunks(view, order)
            # Many collectors changed (a scrape every 15 s sees every busy one changed): one
            # segment per family costs half of one per collector and family. Few changed (HA
            # pairs, short intervals): keep a segment per collector and family, reuse the rest.
            per_piece = (self.rendered - before) * 4 <= len(cs)
            sums = Sums()
            for ch in cs:
                sums.merge(ch.sums)
            by: dict[str, list[bytes]] = {}
            for name, col in self._plan.fleet(view, order, sums).items():
                family = self._level.get(name)
                if family is None:
                    family = self._level[name] = self._family_text(name)
                by[name] = [family.fill(col, ["fleet"]).whole]
            taken: set[str] = set()
            deflate = _Deflate(self.gzip_level) if gzip else None
            if deflate is None or not per_piece:  # whole families: no segment per collector
                if blocks is not None:  # every collector's lines read now, in order
                    for written in blocks:
                        for name, filled in written:
                            by.setdefault(name, []).append(filled.whole)
                else:
                    for ch in cs:
                        for name, text in ch.text.items():
                            by.setdefault(name, []).append(text)
                body = self._families(by, taken, openmetrics, deflate)
                rest = encoder(Listed(rest_families(view, extra, taken)))
                if deflate is None:
                    return b"".join([*(p for p, _ in body), rest])
                return _gzip([*body, (rest, None)] if rest else body, deflate)
            pieces: list[tuple[bytes, bytes | None]] = []  # (plain, cached segment or None)
            for name in _NAMES:
                parts: list[tuple[bytes, bytes | None]] = [(t, None) for t in by.get(name, ())]
                for ch in cs:
                    lines = ch.text.get(name)
                    if lines:
                        seg = ch.gz.get(name)
                        if seg is None:
                            seg = ch.gz[name] = deflate(lines)
                        parts.append((lines, seg))
                if not parts:
                    continue
                taken.add(_FAMILY[name])
                pieces.append(self._header(name, openmetrics))
                pieces.extend(parts)
            rest = encoder(Listed(rest_families(view, extra, taken)))
            if rest:
                pieces.append((rest, None))
            return _gzip(pieces, deflate)

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

    def _header(self, name: str, om: bool) -> tuple[bytes, bytes | None]:
        hit = self._headers.get((name, om))
        if hit is None:
            text = header(name, om).encode()
            hit = self._headers[(name, om)] = (text, _Deflate(self.gzip_level)(text))
        return hit

    def _family_text(self, name: str, per: PerCollector | None = None) -> FamilyText:
        return FamilyText(name, self._plan.names[name], BY_NAME[name].type == "histogram", per)

    def _chunks(
        self, view: FleetView, order: list[CollectorView]
    ) -> tuple[list[Chunk], list[list[tuple[str, Filled]]] | None]:
        """Each collector's chunk, in order: reused when its key is unchanged; and when all of
        them were read now, each block's lines per family."""
        by_c = groups(view)
        fresh: dict[str, tuple[int, tuple[Any, ...], Chunk]] = {}
        out: list[Chunk | None] = []
        todo: list[int] = []
        keys = []
        for c in order:
            cid = c.info.collector_id
            g = by_c.get(cid, EMPTY)
            # scheduler entries are joined per rank across collectors (analysis/fleet.py)
            key = (c.up, tuple([s.capacity_tokens for s in g.streams]), tuple(g.scheduler))
            keys.append(key)
            hit = self._cache.get(cid)
            if hit is not None and hit[0] == c.serial and hit[1] == key:
                out.append(hit[2])
            else:
                out.append(None)
                todo.append(len(out) - 1)
        lines: list[list[tuple[str, Filled]]] | None = None
        if todo:
            lines = []
            for b in range(0, len(todo), self.block):
                block = todo[b : b + self.block]
                cgs = [(order[i], by_c.get(order[i].info.collector_id, EMPTY)) for i in block]
                memo = self._memo.get(b)
                if memo is None:
                    memo = self._memo[b] = Memo(collectors=self._seen.collectors)
                batch = self._plan.batch(cgs, memo=memo)
                texts = self._texts.setdefault(b, {})
                written = self._written(batch, [c.info.collector_id for c, _ in cgs], texts)
                for j, i in enumerate(block):
                    out[i] = Chunk(written, j, batch.sums[j], batch.claims[j], batch.clean[j])
                lines.append(written)
            self.rendered += len(todo)
        done = [ch for ch in out if ch is not None]
        for c, key, ch in zip(order, keys, done, strict=True):
            fresh[c.info.collector_id] = (c.serial, key, ch)
        if len(fresh) < len(self._cache):  # a forgotten collector leaves the cache
            for name, per in self._per.items():
                self._per[name] = {k: v for k, v in per.items() if k in fresh}
            self._texts = {}  # made again with the new dicts
            self._seen.forget(fresh)
            for memo in self._memo.values():
                memo.collectors = self._seen.collectors
        self._cache = fresh
        clashing = sorted({*(i for i, ch in enumerate(done) if not ch.clean), *_clashes(done)})
        if clashing:
            cgs = [(order[i], by_c.get(order[i].info.collector_id, EMPTY)) for i in clashing]
            batch = self._plan.batch(cgs, dedupe=set())
            first_copies = self._written(batch, [c.info.collector_id for c, _ in cgs], None)
            for j, i in enumerate(clashing):
                done[i] = Chunk(first_copies, j, batch.sums[j], batch.claims[j])
            lines = None
        return done, lines if len(todo) == len(done) else None

    def _written(
        self, batch: Batch, ids: list[str], texts: dict[str, FamilyText] | None
    ) -> list[tuple[str, Filled]]:
        """The batch's lines, per family in catalog order, from each family's templates
        (`texts` None: made for this batch only, as for a label clash)."""
        out = []
        for name, col in batch.columns.items():
            got = texts.get(name) if texts is not None else None
            if got is not None:
                family = got
            elif texts is None:
                family = self._family_text(name)
            else:
                family = texts[name] = self._family_text(name, self._per.setdefault(name, {}))
            out.append((name, family.fill(col, ids)))
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
