"""The series a FleetView serves, read off it by the catalog's rows (export/catalog.py).

Collectors are read in order (live ones first, then by id: a label clash keeps the first live
copy). Each family's series are one `Column` (label values, value, the collector it belongs
to), read column-wise: a row's values for every item at once, so the cost per sample stays in
C: a row's function that only reads attributes (`lambda s: s.stats.gaps`) is read as
operator.attrgetter of the same path (`reader`), mapped over the items. A row's selection
(`only`, the stale rule) comes first: its values and labels are read off the items it serves.
Values that the series budget sums per worker are summed per worker instead (export/sums.py),
served by the fleet-level part.

export/prometheus.py turns the columns into prometheus_client Metric objects (the reference);
export/scrape.py turns them into text (export/templates.py).
"""

from __future__ import annotations

import dis
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from itertools import chain, compress, repeat
from operator import add, and_, attrgetter, getitem, is_not, not_, truth
from typing import Any, TypeVar

from kvobserve.analysis.views import CollectorView, FleetView, StreamView
from kvobserve.export.catalog import (
    CATALOG,
    SCOPES,
    SHARD_LABELLED,
    STREAM,
    From,
    FromFleet,
    MetricDef,
    Scope,
    When,
)
from kvobserve.export.sums import Grouping, Labels, Sums
from kvobserve.wire.snapshot import (
    BindStats,
    CollectorCounters,
    RelayStats,
    SchedulerStats,
    UnexpectedStream,
)

R = TypeVar("R")


@dataclass(frozen=True)
class Detail:
    """Which series are served, beyond the default budget (docs/metrics.md, series budget)."""

    # [aggregator] per_stream_detail: the catalog's `detail` rows per stream (block and event
    # counters, block lifetimes) instead of per worker, and its `detail_only` rows (restore
    # gaps, tier moves, LoRA blocks, placement)
    per_stream_detail: bool = False
    shard: str = ""  # sharded aggregators: the `shard` label of per-collector and own series


def reader(fn: Callable[[Any], R]) -> Callable[[Any], R]:
    """`fn`, or operator.attrgetter of the same path when `fn` only reads attributes of its
    item and returns the last (`lambda s: s.stats.gaps`): the same values, read in C. Told by
    its bytecode (load the argument, read attributes, return), so a function that tests or
    calls anything keeps running as written."""
    code = getattr(fn, "__code__", None)
    if code is None or code.co_argcount != 1 or code.co_flags & _VARARGS:
        return fn
    ops = [i for i in dis.get_instructions(code) if i.opname not in ("RESUME", "NOP")]
    if (
        len(ops) < 3
        or (ops[0].opname, ops[0].argval) != ("LOAD_FAST", code.co_varnames[0])
        or ops[-1].opname != "RETURN_VALUE"
        or any(i.opname != "LOAD_ATTR" for i in ops[1:-1])
    ):
        return fn
    return attrgetter(".".join(str(i.argval) for i in ops[1:-1]))


_VARARGS = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS


@dataclass
class Group:
    """One collector's part of a FleetView."""

    streams: list[StreamView] = field(default_factory=list)
    unexpected: list[UnexpectedStream] = field(default_factory=list)
    scheduler: list[SchedulerStats] = field(default_factory=list)


EMPTY = Group()


def ordered(v: FleetView) -> list[CollectorView]:
    """Live collectors by id, then down ones by id: the order series are served in."""
    return [c for c in v.collectors if c.up] + [c for c in v.collectors if not c.up]


def groups(v: FleetView) -> dict[str, Group]:
    """Streams, unexpected streams and scheduler stats of the view by collector id."""
    out: dict[str, Group] = {}
    for s in v.streams:
        cid = s.collector.collector_id
        g = out.get(cid)
        if g is None:
            g = out[cid] = Group()
        g.streams.append(s)
    for u, info in v.unexpected:
        out.setdefault(info.collector_id, Group()).unexpected.append(u)
    for sch, info in v.scheduler:
        out.setdefault(info.collector_id, Group()).scheduler.append(sch)
    return out


class Column:
    """One family's series over a batch: label values, values and each one's collector."""

    __slots__ = ("labels", "owner", "values")

    def __init__(self, labels: list[Labels], values: list[Any], owner: list[int]) -> None:
        self.labels = labels
        self.values = values  # numbers, or wire.snapshot.Histogram
        self.owner = owner  # the index in the batch of the collector it belongs to


@dataclass
class Batch:
    """What a Plan reads of some collectors: per family a Column, and the per-worker sums."""

    columns: dict[str, Column]
    summed: dict[str, Column]  # the per-worker sums, label sets sorted
    sums: list[Sums]  # with a seen-set (Plan.batch's `dedupe`): each collector's sums


# A row's labels other than its key: (label, None) for the scope's own, (label, function) for
# one the row reads off each item
ItemLabels = tuple[tuple[str, Callable[[Any], object] | None], ...]
_CONTEXT = frozenset({"collector", "node_rank"})  # an item's labels from its collector


def labels_of(scope: Scope[Any]) -> frozenset[str]:
    """The labels every item of `scope` has: its own, and its collector's or, for a part of an
    item of another scope, that item's."""
    context = _CONTEXT if scope.part_of is None else labels_of(scope.part_of)
    return frozenset(scope.labels) | context


_OWN = {sc: {n: reader(get) for n, get in sc.labels.items()} for sc in SCOPES}


@dataclass
class Memo:
    """What one read of the fleet leaves for the next: label sets (so that equal ones are the
    same objects, compared by identity), the groupings of the per-worker sums, and more."""

    last: dict[object, Any] = field(default_factory=dict)


class _Items:
    """One scope's items over a batch: each one's collector, its labels (read on first use),
    and whether it is up (None: all are)."""

    def __init__(
        self,
        items: list[Any],
        owner: list[int],
        labels: dict[str, Callable[[], list[str]]],
        live: Callable[[], list[bool] | None] = lambda: None,
        vouched: Callable[[], list[bool] | None] = lambda: None,
    ) -> None:
        self.scope: Scope[Any] | None = None  # set by _scopes
        self.items = items
        self.owner = owner
        self._make = labels
        self._labels: dict[str, list[str]] = {}
        self._live = live
        self._live_got: tuple[list[bool] | None] | None = None
        self._vouched = vouched
        self._vouched_got: tuple[list[bool] | None] | None = None
        self.keys: dict[object, list[Labels]] = {}  # label value tuples by (labels, selection)
        self.memo: Memo | None = None  # what the last read left, to reuse (Plan.batch)

    def interned(self, key: object, keys: list[Labels]) -> list[Labels]:
        """`keys`, or the last read's list under `key` when equal (so that comparing a
        template's label sets with the last ones is an identity check)."""
        memo = self.memo
        if memo is None:
            return keys
        last = memo.last.get((self.scope, key))
        if last is not None and last == keys:
            return last
        memo.last[(self.scope, key)] = keys
        return keys

    def keys_of(self, item_labels: ItemLabels) -> list[Labels]:
        """Every item's label values as tuples, interned: (label, None) the scope's own label,
        (label, function) one the function reads off the item."""
        cache = (item_labels, True)
        got = self.keys.get(cache)
        if got is None:
            cols = [
                self.label(n) if get is None else list(map(str, map(get, self.items)))
                for n, get in item_labels
            ]
            got = list(zip(*cols, strict=True)) if cols else [()] * len(self.items)
            got = self.keys[cache] = self.interned(cache, got)
        return got

    def label(self, name: str) -> list[str]:
        """The scope's label `name` of every item."""
        got = self._labels.get(name)
        if got is None:
            got = self._labels[name] = self._make[name]()
        return got

    @property
    def live(self) -> list[bool] | None:
        """Whether each item is up (served by rows whose `stale` is False); None: all are."""
        if self._live_got is None:
            self._live_got = (self._live(),)
        return self._live_got[0]

    @property
    def vouched(self) -> list[bool] | None:
        """Whether each item is up and its index vouches for it (served by rows whose
        `vouched` is set); None: all are."""
        if self._vouched_got is None:
            live, ok = self.live, self._vouched()
            if live is None or ok is None:
                both = ok if live is None else live
            else:
                both = list(map(and_, live, ok))
            self._vouched_got = (both,)
        return self._vouched_got[0]


class _Row:
    """A catalog row as one batch reads it."""

    def __init__(self, m: MetricDef, src: From[Any], detail: Detail) -> None:
        self.name = m.name
        self.hist = m.type == "histogram"
        self.scope = src.scope
        per_stream = m.detail and detail.per_stream_detail
        self.summed = m.summed and not per_stream
        names = m.detail_labels if per_stream else m.labels
        self.shard = detail.shard if m.name in SHARD_LABELLED and detail.shard else ""
        self.names = (*names, "shard") if self.shard else names
        self.key = (src.key or names[-1]) if src.each or src.fixed else ""
        own = {n: reader(get) for n, get in src.labels}
        self.item_labels: ItemLabels = tuple((n, own.get(n)) for n in names if n != self.key)
        unknown = [
            n for n, get in self.item_labels if get is None and n not in labels_of(src.scope)
        ]
        if unknown:
            raise ValueError(f"{m.name}: labels {unknown} are not the {src.scope!r} scope's")
        self.live = m.stale is False
        self.vouched = m.vouched
        self.only = reader(src.only) if src.only is not None else None
        self.value: Callable[[Any], Any] | None = None
        self.const: int | None = None
        if isinstance(src.value, int):
            self.const = src.value
        elif src.value is not None:
            self.value = reader(src.value)
        self.when = src.when
        self.each: Callable[[Any], Any] | None = None  # dicts: read by key, column-wise
        if src.each is not None:
            self.each = reader(src.each)
        self.first = src.first
        self.fixed = [(lv, reader(get)) for lv, get in src.fixed]

    def _select(
        self, sc: _Items, track: bool
    ) -> tuple[list[Any], list[int], list[Labels], list[int] | None]:
        """(the items served, their collectors, their labels but the key, with `track` their
        positions in the scope)."""
        items, owner = sc.items, sc.owner
        sel = sc.vouched if self.vouched else sc.live if self.live else None
        if self.only is not None:
            mask = list(map(truth, map(self.only, items)))
            sel = mask if sel is None else list(map(and_, sel, mask))
        if sel is None:
            return (
                items,
                owner,
                sc.keys_of(self.item_labels),
                (list(range(len(items))) if track else None),
            )
        at = list(compress(range(len(items)), sel)) if track else None
        items = list(compress(items, sel))
        owner = list(compress(owner, sel))
        # label sets kept for the next read, by selection (up, or up and vouched)
        cache = (self.item_labels, "vouched" if self.vouched else False)
        kept = sc.vouched if self.vouched else sc.live
        keys = sc.keys.get(cache) if sel is kept else None
        if keys is None:  # the scope's labels of the items served; the row's read off them
            cols = [
                list(compress(sc.label(n), sel)) if get is None else list(map(str, map(get, items)))
                for n, get in self.item_labels
            ]
            keys = list(zip(*cols, strict=True)) if cols else [()] * len(items)
            if sel is kept:
                keys = sc.keys[cache] = sc.interned(cache, keys)
        return items, owner, keys, at

    def _values(self, items: list[Any]) -> list[Any]:
        if self.const is not None:
            return [self.const] * len(items)
        assert self.value is not None
        return list(map(self.value, items))

    def _served(self, values: list[Any]) -> list[bool] | None:
        """Which values `when` serves; None: all of them."""
        if self.when is When.ALWAYS or not values:
            return None
        if self.when is When.SET:
            mask = list(map(is_not, values, repeat(None)))
        else:
            mask = list(map(truth, values))
        return None if all(mask) else mask

    def read(self, sc: _Items, track: bool = False) -> tuple[Column, list[int] | None]:
        """The row's series over the scope's items (label values in `names` order), and with
        `track`, the item each one was read from."""
        items, owner, keys, at = self._select(sc, track)
        if self.each is not None:
            labels, values, pos = self._each(items, keys, sc.memo)
            owner = list(map(owner.__getitem__, pos))
            if at is not None:
                at = list(map(at.__getitem__, pos))
        elif self.fixed:
            n = len(self.fixed)
            labels = [(*k, lv) for k in keys for lv, _ in self.fixed]
            cols = [list(map(get, items)) for _, get in self.fixed]
            values = list(chain.from_iterable(zip(*cols, strict=True)))
            owner = list(chain.from_iterable(repeat(o, n) for o in owner))
            if at is not None:
                at = list(chain.from_iterable(repeat(i, n) for i in at))
        else:
            labels = keys
            values = self._values(items)
        mask = self._served(values)
        if mask is not None:
            labels = list(compress(labels, mask))
            values = list(compress(values, mask))
            owner = list(compress(owner, mask))
            if at is not None:
                at = list(compress(at, mask))
        if self.shard:
            labels = [(*k, self.shard) for k in labels]
        return Column(labels, values, owner), at

    def totals(self, sc: _Items) -> Column | None:
        """The row's values summed per label set (its worker's, ...) over the scope's items,
        label sets sorted; none of the items repeats a stream (else: Plan.batch's `dedupe`)."""
        items, owner, keys, _ = self._select(sc, False)
        if not items:
            return None
        put = self.names.index(self.key) if self.key else 0  # where a key's label goes
        # (key label or None, the items' label sets, collectors, values) to sum
        parts: list[tuple[str | None, list[Labels], list[int], list[Any]]]
        if self.each is not None:
            dicts = list(map(self.each, items))
            parts = [
                (k, keys, owner, list(map(dict.get, dicts, repeat(k), repeat(0))))
                for k in self.first
            ]
            first = frozenset(self.first)
            odd = list(compress(range(len(dicts)), map(not_, map(first.issuperset, dicts))))
            for k in sorted({k for i in odd for k in dicts[i] if k not in first}):
                has = [i for i in odd if k in dicts[i]]  # keys besides the `first` ones: few
                parts.append(
                    (k, [keys[i] for i in has], [owner[i] for i in has], [dicts[i][k] for i in has])
                )
        elif self.fixed:
            parts = [(lv, keys, owner, list(map(get, items))) for lv, get in self.fixed]
        else:
            parts = [(None, keys, owner, self._values(items))]
        values: list[Any] = []
        groupings = sc.memo.last if sc.memo is not None else {}
        used: list[tuple[str | None, Grouping]] = []
        for k, ks, os, vs in parts:
            mask = self._served(vs)
            if mask is not None:
                ks, os, vs = (
                    list(compress(ks, mask)),
                    list(compress(os, mask)),
                    list(compress(vs, mask)),
                )
            if not vs:
                continue
            g = groupings.get(("sums", self.name, k))
            if g is None or g.keys != ks or g.owner != os:
                g = groupings[("sums", self.name, k)] = Grouping(ks, os)
            values.extend(g.histograms(vs) if self.hist else g.sums(vs))
            used.append((k, g))
        # the label sets, sorted (and how the values follow them): kept while the groupings are
        merged = groupings.get(("merged", self.name))
        if merged is None or [(k, id(g)) for k, g in merged[0]] != [(k, id(g)) for k, g in used]:
            labels: list[Labels] = []
            for k, g in used:
                labels.extend(
                    g.labels if k is None else [(*b[:put], k, *b[put:]) for b in g.labels]
                )
            order = sorted(range(len(labels)), key=labels.__getitem__) if len(used) > 1 else None
            if order is not None:
                labels = list(map(labels.__getitem__, order))
            merged = groupings[("merged", self.name)] = (used, labels, order)
        _, labels, order = merged
        if order is not None:
            values = list(map(values.__getitem__, order))
        return Column(labels, values, [0] * len(values))

    def _each(
        self, items: list[Any], keys: list[Labels], memo: Memo | None
    ) -> tuple[list[Labels], list[Any], list[int]]:
        """One series per key of each item's dict (the `first` keys always, then the others
        sorted), the key where the row's labels name it; and the item each one was read from.
        Column-wise: the usual dicts (none, or only `first` keys) without a loop per item;
        the label sets made again only when the items' keys or label sets changed."""
        assert self.each is not None
        first = self.first
        dicts = list(map(self.each, items))
        n = len(dicts)
        if not first and not any(dicts):
            return [], [], []
        if not first:
            pos = list(chain.from_iterable(map(repeat, range(n), map(len, dicts))))
            names = list(chain.from_iterable(map(sorted, dicts)))
            values = list(map(getitem, map(dicts.__getitem__, pos), names))
        elif all(map(frozenset(first).issuperset, dicts)):  # no keys besides the first ones
            pos = list(chain.from_iterable(map(repeat, range(n), repeat(len(first)))))
            names = list(first) * n
            got = [map(dict.get, dicts, repeat(k), repeat(0)) for k in first]
            values = list(chain.from_iterable(zip(*got, strict=True)))
        else:
            pos, names, values = [], [], []
            for i, d in enumerate(dicts):
                for k in (*first, *sorted(k for k in d if k not in first)):
                    pos.append(i)
                    names.append(k)
                    values.append(d.get(k, 0))
        at = self.names.index(self.key)
        cached = memo.last.get((self.name, "each")) if memo is not None else None
        if cached is not None and cached[0] is keys and cached[1] == names and cached[2] == pos:
            return cached[3], values, pos
        if keys and at == len(keys[0]):  # the key is the last label
            labels = list(map(add, map(keys.__getitem__, pos), zip(names)))
        else:
            labels = [(*keys[i][:at], k, *keys[i][at:]) for i, k in zip(pos, names, strict=True)]
        if memo is not None:
            memo.last[(self.name, "each")] = (keys, names, pos, labels)
        return labels, values, pos


def _concat(parts: Iterable[list[Any]]) -> list[Any]:
    return list(chain.from_iterable(parts))


class Plan:
    """The catalog's rows for one Detail: which families are served, labelled how, read how."""

    def __init__(self, detail: Detail | None = None) -> None:
        self.detail = d = detail or Detail()
        self.rows: list[_Row] = []
        self.fleet_rows: list[tuple[MetricDef, FromFleet]] = []
        self.summed_names: list[str] = []  # families served from the sums, in catalog order
        self.names: dict[str, tuple[str, ...]] = {}  # label names of each family as served
        for m in CATALOG:
            src = m.source
            if src is None or (m.detail_only and not d.per_stream_detail):
                continue
            if isinstance(src, FromFleet):
                self.fleet_rows.append((m, src))
                shard = d.shard and m.name in SHARD_LABELLED
                self.names[m.name] = (*m.labels, "shard") if shard else m.labels
                continue
            row = _Row(m, src, d)
            self.rows.append(row)
            self.names[m.name] = row.names
            if row.summed:
                self.summed_names.append(m.name)

    def batch(
        self,
        cgs: list[tuple[CollectorView, Group]],
        dedupe: set[object] | None = None,
        memo: Memo | None = None,
    ) -> Batch:
        """The series of these collectors (in this order). `dedupe`: a seen-set: the first copy
        of a series wins, and a stream is summed into its worker's series once, one series at a
        time into each collector's Sums (the reference; any read where some collector's items
        repeat a label set is made so). Else a row's values are summed at once (_Row.totals).
        `memo`: what the last read left, kept by the caller."""
        scopes = _scopes(cgs)
        for sc in scopes.values():
            sc.memo = memo
        if dedupe is None and _repeats(scopes):
            dedupe = set()
        sums = [Sums() for _ in cgs] if dedupe is not None else []
        columns: dict[str, Column] = {}
        summed: dict[str, Column] = {}
        for row in self.rows:
            sc = scopes[row.scope]
            if row.summed and dedupe is None:
                got = row.totals(sc)
                if got is not None and got.values:
                    summed[row.name] = got
                continue
            col, at = row.read(sc, dedupe is not None)
            if not col.values:
                continue
            if dedupe is not None and at is not None:
                col = _first_copies(row, sc, col, at, dedupe)
            if not row.summed:
                if col.values:
                    columns[row.name] = col
                continue
            add = Sums.add_histogram if row.hist else Sums.add
            for labels, v, o in zip(col.labels, col.values, col.owner, strict=True):
                add(sums[o], row.name, labels, v)
        if dedupe is not None:
            total = Sums()
            for s in sums:
                total.merge(s)
            for name in self.summed_names:
                keys, values = total.series(name)
                if values:
                    summed[name] = Column(keys, values, [0] * len(values))
        return Batch(columns, summed, sums)

    def fleet(
        self, v: FleetView, order: list[CollectorView], summed: dict[str, Column]
    ) -> dict[str, Column]:
        """The fleet-level series: the rows read off the whole view, and the per-worker sums
        (`summed`: Batch.summed), in catalog order."""
        out: dict[str, Column] = {}
        shard = self.detail.shard
        for m, src in self.fleet_rows:
            got = list(src.samples(v, order))
            if not got:
                continue
            labels = [k for k, _ in got]
            if shard and m.name in SHARD_LABELLED:
                labels = [(*k, shard) for k in labels]
            out[m.name] = Column(labels, [x for _, x in got], [0] * len(got))
        for name in self.summed_names:
            col = summed.get(name)
            if col is not None:
                out[name] = col
        return out


def _first_copies(row: _Row, sc: _Items, col: Column, at: list[int], seen: set[object]) -> Column:
    """The series of `col` not served yet: by label set, or for a summed row, by the item (a
    stream's, or a storage tier's: worker, node, rank, medium) and the label set it adds to
    (the first copy wins; two tiers of a stream add to a worker's series both)."""
    if row.summed:
        assert sc.scope is not None
        items = sc.keys_of(tuple((n, None) for n in _IDENTITY[sc.scope]))
        keys: list[object] = [(row.name, items[i], k) for i, k in zip(at, col.labels, strict=True)]
    else:
        keys = [(row.name, k) for k in col.labels]
    keep = []
    for k in keys:
        keep.append(k not in seen)
        seen.add(k)
    if all(keep):
        return col
    return Column(*(list(compress(x, keep)) for x in (col.labels, col.values, col.owner)))


def _read(get: Callable[[Any], object], items: list[Any]) -> list[str]:
    return list(map(str, map(get, items)))


def _via(whole: _Items, name: str, parent: list[int]) -> list[str]:
    return list(map(whole.label(name).__getitem__, parent))


def _part_live(whole: _Items, parent: list[int]) -> Callable[[], list[bool] | None]:
    """Whether each item is up: while the item it is part of is."""

    def live() -> list[bool] | None:
        up = whole.live
        return None if up is None else list(map(up.__getitem__, parent))

    return live


def _none() -> None:
    return None


def _scopes(cgs: list[tuple[CollectorView, Group]]) -> dict[Scope[Any], _Items]:
    """Every scope's items over the batch."""
    nodes = [str(c.info.node_rank) for c, _ in cgs]
    cids = [c.info.collector_id for c, _ in cgs]
    up = [c.up for c, _ in cgs]
    out: dict[Scope[Any], _Items] = {}

    def add(
        scope: Scope[Any],
        items: list[Any],
        owner: list[int],
        live: Callable[[], list[bool] | None] = _none,
        parent: list[int] | None = None,
        vouched: Callable[[], list[bool] | None] = _none,
    ) -> _Items:
        """The scope's items, labelled (on first use) by their own labels and those of their
        collector, or with `parent` (the position of each one's whole among the items of the
        scope it is part of) those of their whole."""
        made: dict[str, Callable[[], list[str]]] = {}
        if scope.part_of is None:
            made["collector"] = lambda: list(map(cids.__getitem__, owner))
            made["node_rank"] = lambda: list(map(nodes.__getitem__, owner))
        else:
            assert parent is not None
            whole = out[scope.part_of]
            for n in labels_of(scope.part_of):
                made[n] = partial(_via, whole, n, parent)
        for n, get in _OWN[scope].items():
            made[n] = partial(_read, get, items)
        sc = out[scope] = _Items(items, owner, made, live, vouched)
        sc.scope = scope
        return sc

    def collectors_up(owner: list[int]) -> Callable[[], list[bool] | None]:
        return lambda: None if all(up) else list(map(up.__getitem__, owner))

    def per_collector(
        get: Callable[[CollectorView, Group], list[R]],
    ) -> tuple[list[R], list[int]]:
        parts = [get(c, g) for c, g in cgs]
        return _concat(parts), _concat([i] * len(p) for i, p in enumerate(parts))

    streams, s_owner = per_collector(lambda c, g: g.streams)

    def s_live() -> list[bool] | None:
        up = list(map(attrgetter("up"), streams))
        return None if all(up) else up

    def s_vouched() -> list[bool] | None:
        ok = list(map(attrgetter("stats.vouched"), streams))
        return None if all(ok) else ok

    st = add(Scope.STREAM, streams, s_owner, s_live, vouched=s_vouched)
    media_lists = list(map(attrgetter("stats.media"), streams))
    if all(len(ms) == 1 for ms in media_lists):
        media = [ms[0] for ms in media_lists]
        parent = list(range(len(media)))
    else:
        media = _concat(media_lists)
        parent = _concat([i] * len(ms) for i, ms in enumerate(media_lists))
    m_owner = list(map(s_owner.__getitem__, parent))
    vouched = s_vouched()
    add(Scope.MEDIUM, media, m_owner, _part_live(st, parent), parent,
        (lambda: None) if vouched is None else (lambda: list(map(vouched.__getitem__, parent))))  # fmt: skip

    of_items: list[tuple[Scope[Any], Callable[[CollectorView, Group], list[Any]]]] = [
        (Scope.SCHEDULER, lambda c, g: g.scheduler),
        (Scope.UNEXPECTED, lambda c, g: g.unexpected),
        (Scope.DRIFT, _drift),
        (Scope.DRIFT_SOURCE, lambda c, g: c.snapshot.drift_sources if c.up else []),
        (Scope.SOURCE_ERROR, lambda c, g: c.snapshot.scheduler_errors),
    ]
    for scope, get in of_items:
        add(scope, *per_collector(get))
    of_live: list[tuple[Scope[Any], Callable[[CollectorView, Group], list[Any]]]] = [
        (Scope.WORKER, lambda c, g: c.snapshot.workers),
        (Scope.SOURCE, lambda c, g: c.snapshot.sources),
    ]
    for scope, get in of_live:
        items, owner = per_collector(get)
        add(scope, items, owner, collectors_up(owner))
    binds: list[BindStats]
    binds, b_owner = per_collector(lambda c, g: c.snapshot.binds)
    bound = add(Scope.BIND, binds, b_owner, collectors_up(b_owner))
    relays: list[RelayStats] = []
    r_parent: list[int] = []
    for i, b in enumerate(binds):
        if b.relay is not None:
            relays.append(b.relay)
            r_parent.append(i)
    r_owner = list(map(b_owner.__getitem__, r_parent))
    add(Scope.RELAY, relays, r_owner, _part_live(bound, r_parent), r_parent)

    collectors = [c for c, _ in cgs]
    add(Scope.COLLECTOR, collectors, list(range(len(cgs))))
    counters: list[CollectorCounters] = []
    k_parent: list[int] = []
    for i, c in enumerate(collectors):
        if c.snapshot.counters is not None:
            counters.append(c.snapshot.counters)
            k_parent.append(i)
    add(Scope.COUNTERS, counters, k_parent, parent=k_parent)
    return out


def _drift(c: CollectorView, g: Group) -> list[Any]:
    """A live collector's drift entries, but those of its streams that are down (their index
    no longer follows the engine: nothing to compare)."""
    drift = c.snapshot.drift
    if not drift or not c.up:
        return []
    down = {(s.stats.worker_id, s.stats.dp_rank) for s in g.streams if not s.up}
    return [d for d in drift if (d.worker_id, d.dp_rank) not in down] if down else list(drift)


# the labels that tell a scope's items apart: every row of the scope serves them, so no two of
# its series are the same while no two items are (the collector scope: one item per collector)
_IDENTITY: dict[Scope[Any], tuple[str, ...]] = {
    Scope.STREAM: STREAM,
    Scope.MEDIUM: (*STREAM, "medium"),
    Scope.SCHEDULER: STREAM,
    Scope.UNEXPECTED: (*STREAM, "endpoint"),
    Scope.DRIFT: (*STREAM, "medium", "method"),
    Scope.SOURCE_ERROR: ("worker_id", "node_rank", "source", "reason"),
    Scope.DRIFT_SOURCE: ("collector", "worker_id"),
    Scope.WORKER: ("collector", "worker_id", "state"),
    Scope.SOURCE: ("collector", "worker_id", "source", "state"),
    Scope.BIND: ("collector", "worker_id", "dp_rank"),
    Scope.RELAY: ("collector", "worker_id", "dp_rank"),
}


def _repeats(scopes: dict[Scope[Any], _Items]) -> bool:
    """Whether two items of a scope have the same label sets (two collectors claim a stream,
    a collector repeats one of its own): then the first copy of each series wins."""
    for scope, names in _IDENTITY.items():
        sc = scopes[scope]
        if len(sc.items) < 2:
            continue
        keys = sc.keys_of(tuple((n, None) for n in names))
        memo = sc.memo
        hit = memo.last.get(("unique", scope)) if memo is not None else None
        if hit is not None and hit[0] is keys:
            unique = hit[1]
        else:
            unique = len(set(keys)) == len(keys)
            if memo is not None:
                memo.last[("unique", scope)] = (keys, unique)
        if not unique:
            return True
    return False
