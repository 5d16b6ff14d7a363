"""The series a FleetView serves, read off it by the catalog's rows (export/catalog.py).

Collectors are read in batches (live ones first, then by id: a label clash keeps the first live
copy). Each family's series over a batch is one `Column` (label values, value, the collector it
belongs to), read column-wise: a row's values for every item of the batch at once
(operator.attrgetter over the items), so the cost per sample stays in C. Values that the series
budget sums per worker go into each collector's `Sums` instead, served by the fleet-level part.

export/prometheus.py turns the columns into prometheus_client Metric objects (the reference);
export/scrape.py turns them into text kept per collector (export/templates.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import chain, compress, groupby, repeat
from operator import attrgetter, is_not, methodcaller, not_, truth
from typing import Any

from kvobserve.analysis.views import CollectorView, FleetView, StreamView
from kvobserve.export.catalog import (
    CATALOG,
    SHARD_LABELLED,
    STREAM,
    From,
    FromFleet,
    MetricDef,
    Scope,
    When,
)
from kvobserve.export.sums import Labels, Sums
from kvobserve.wire.snapshot import SchedulerStats, UnexpectedStream


@dataclass(frozen=True)
class Detail:
    """Per-stream series beyond the default budget (docs/metrics.md, series budget)."""

    histograms: bool = False  # kvobserve_kv_block_lifetime_seconds per stream and medium
    counters: bool = False  # kvobserve_kv_events_total, _blocks_stored/_removed_total per stream
    shard: str = ""  # sharded aggregators: the `shard` label of per-collector and own series

    def on(self, flag: str) -> bool:
        """Whether a catalog row's `detail`/`optin` flag is set."""
        return {"per_stream_counters": self.counters, "per_stream_histograms": self.histograms}[
            flag
        ]


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
    """A batch's series: per family a Column; per collector its sums and its claims."""

    columns: dict[str, Column]
    sums: list[Sums]
    claims: list[frozenset[Labels]]  # label sets another collector's series could repeat
    clean: list[bool]  # False: a collector whose own items repeat (read it with a seen-set)


_WORKER, _DP = attrgetter("worker_id"), attrgetter("dp_rank")


@dataclass
class Memo:
    """Label sets read before, kept from one batch to the next by whoever reads them."""

    batch: dict[object, list[Labels]] = field(default_factory=dict)  # a block's, by row kind
    collectors: dict[tuple[object, str], list[Labels]] = field(default_factory=dict)

    def forget(self, keep: set[str] | dict[str, Any]) -> None:
        """Drop what collectors not in `keep` had."""
        self.collectors = {k: v for k, v in self.collectors.items() if k[1] in keep}


class _Items:
    """One scope's items over a batch: each one's collector, its labels (read on first use),
    and whether it is up (None: all are)."""

    def __init__(
        self,
        items: list[Any],
        owner: list[int],
        labels: dict[str, Callable[[], list[str]]],
        live: Callable[[], list[bool] | None] = lambda: None,
    ) -> None:
        self.items = items
        self.owner = owner
        self._make = labels
        self._labels: dict[str, list[str]] = {}
        self._live = live
        self._live_got: tuple[list[bool] | None] | None = None
        self.keys: dict[object, list[Labels]] = {}  # label value tuples by (labels, selection)
        self.memo: Memo | None = None  # the label sets read before, to reuse (Plan.batch)
        self.ids: list[str] = []  # the batch's collectors
        self._runs: dict[object, list[Run]] = {}

    def runs(self, cache: object, owner: list[int], keys: list[Labels]) -> list[Run]:
        """The runs of items with the same collector and labels (cached for `cache`)."""
        got = self._runs.get(cache) if cache is not None else None
        if got is None:
            got = _spans(owner, keys)
            if cache is not None:
                self._runs[cache] = got
        return got

    def interned(self, key: object, keys: list[Labels], owner: list[int]) -> list[Labels]:
        """`keys`, made of the label sets read before where they are equal (so that comparing
        a template's labels with the last ones is an identity check): the batch's before,
        else each collector's."""
        memo = self.memo
        if memo is None:
            return keys
        last = memo.batch.get(key)
        if last is not None and last == keys:
            return last
        out: list[Labels] = []
        start = 0
        ids, mine = self.ids, memo.collectors
        for o, run in groupby(owner):  # each collector's items are consecutive
            end = start + len(list(run))
            new = keys[start:end]
            had = mine.get((key, ids[o]))
            if had is not None and had == new:
                out.extend(had)
            else:
                mine[(key, ids[o])] = new
                out.extend(new)
            start = end
        memo.batch[key] = out
        return out

    def label(self, name: str, path: str = "") -> list[str]:
        """Label `name` of every item: the scope's own, else read at `path` (by default the
        item's attribute of that name)."""
        make = self._make.get(name)
        key = name if make is not None else f"{name}={path or name}"
        got = self._labels.get(key)
        if got is None:
            if make is not None:
                got = make()
            else:
                got = list(map(str, map(attrgetter(path or name), self.items)))
            self._labels[key] = got
        return got

    @property
    def live(self) -> list[bool] | None:
        """Whether each item is up (served by rows whose `stale` is False); None: all are."""
        if self._live_got is None:
            self._live_got = (self._live(),)
        return self._live_got[0]


class _Row:
    """A catalog row as one batch reads it."""

    def __init__(self, m: MetricDef, src: From, detail: Detail) -> None:
        self.name = m.name
        self.hist = m.type == "histogram"
        self.scope = src.scope
        per_stream = bool(m.detail) and detail.on(m.detail)
        self.summed = m.summed and not per_stream
        names = m.detail_labels if per_stream else m.labels
        self.shard = detail.shard if m.name in SHARD_LABELLED and detail.shard else ""
        self.names = (*names, "shard") if self.shard else names
        self.key = (src.key or names[-1]) if src.each or src.fixed else ""
        paths = dict(src.labels)
        self.item_labels = tuple((n, paths.get(n, "")) for n in names if n != self.key)
        self.live = m.stale is False
        only = src.only
        self.only: Callable[[Any], object] | None = (
            attrgetter(only) if isinstance(only, str) and only else only or None
        )
        self.value: Callable[[Any], Any] | None = None
        self.const: int | None = None
        if isinstance(src.value, int):
            self.const = src.value
        elif isinstance(src.value, str):
            self.value = attrgetter(src.value) if src.value else None
        else:
            self.value = src.value
        self.when = src.when
        self.each = attrgetter(src.each) if src.each else None
        self.first = src.first
        self.fixed = [(lv, attrgetter(p)) for lv, p in src.fixed]

    def _select(
        self, sc: _Items, track: bool
    ) -> tuple[list[Any], list[int], list[Labels], list[int] | None, object]:
        """(the items served, their collectors, their labels but the key, with `track` their
        positions in the scope, the key their label sets are cached under or None)."""
        items, owner = sc.items, sc.owner
        sel = sc.live if self.live else None
        if self.only is not None:
            mask = list(map(truth, map(self.only, items)))
            sel = mask if sel is None else [a and b for a, b in zip(sel, mask, strict=True)]
        shared = sel is None or sel is sc.live
        cache = (self.item_labels, sel is None)
        keys = sc.keys.get(cache) if shared else None
        at: list[int] | None = None
        if sel is not None:
            if track:
                at = list(compress(range(len(items)), sel))
            items = list(compress(items, sel))
            owner = list(compress(owner, sel))
        elif track:
            at = list(range(len(items)))
        if keys is None:
            cols = [sc.label(n, p) for n, p in self.item_labels]
            if sel is not None:
                cols = [list(compress(c, sel)) for c in cols]
            keys = list(zip(*cols, strict=True)) if cols else [()] * len(items)
            if shared:
                keys = sc.keys[cache] = sc.interned((self.scope, cache), keys, owner)
        return items, owner, keys, at, cache if shared else None

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
        items, owner, keys, at, _ = self._select(sc, track)
        if self.each is not None:
            labels, values, pos = self._each(items, keys)
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

    def sum_into(self, sc: _Items, sums: list[Sums]) -> None:
        """Add the row's values to each collector's per-worker sums, a run of items with the
        same labels at a time (in item order: the floats add() one by one would give)."""
        items, owner, keys, _, cache = self._select(sc, False)
        if not items:
            return

        def add(values: list[Any], insert: Insert) -> None:
            mask = self._served(values)
            if mask is None:
                runs = sc.runs(cache, owner, keys)
            else:
                values = list(compress(values, mask))
                runs = _spans(list(compress(owner, mask)), list(compress(keys, mask)))
            _sum_runs(sums, self.name, self.hist, runs, values, insert)

        if self.each is not None:
            at = self.names.index(self.key)
            dicts = list(map(self.each, items))
            for k in self.first:
                add(list(map(methodcaller("get", k, 0), dicts)), (at, k))
            first = frozenset(self.first)
            for i in compress(range(len(dicts)), map(not_, map(first.issuperset, dicts))):
                d = dicts[i]  # keys besides the `first` ones: few, one by one
                for k in sorted(k for k in d if k not in first):
                    if self._served([d[k]]) is None:
                        run = [(owner[i], keys[i], 0, 1)]
                        _sum_runs(sums, self.name, self.hist, run, [d[k]], (at, k))
        elif self.fixed:
            at = self.names.index(self.key)
            for lv, get in self.fixed:
                add(list(map(get, items)), (at, lv))
        else:
            add(self._values(items), None)

    def _each(
        self, items: list[Any], keys: list[Labels]
    ) -> tuple[list[Labels], list[Any], list[int]]:
        """One series per key of each item's dict (the `first` keys always, then the others
        sorted), the key where the row's labels name it; and the item each one was read from."""
        assert self.each is not None
        first = self.first
        at = self.names.index(self.key)
        last = not keys or at == len(keys[0])
        labels: list[Labels] = []
        values: list[Any] = []
        pos: list[int] = []
        for i, d in enumerate(map(self.each, items)):
            if not d and not first:
                continue
            base = keys[i]
            if len(d) == 1 and not first:  # the usual case: one result, one reason, ...
                for k, v in d.items():
                    labels.append((*base, k) if last else (*base[:at], k, *base[at:]))
                    values.append(v)
                    pos.append(i)
                continue
            rest = sorted(k for k in d if k not in first) if first else sorted(d)
            for k in (*first, *rest):
                labels.append((*base, k) if last else (*base[:at], k, *base[at:]))
                values.append(d.get(k, 0))
                pos.append(i)
        return labels, values, pos


Run = tuple[int, Labels, int, int]  # (collector, label values, first item, item past the last)
Insert = tuple[int, str] | None  # (position, label value) added to each label set, or None


def _spans(owner: list[int], keys: list[Labels]) -> list[Run]:
    """The runs of consecutive items with the same collector and labels."""
    out: list[Run] = []
    start = 0
    for o, run in groupby(owner):  # a collector's items are consecutive
        end = start + len(list(run))
        first = keys[start]
        if keys[start:end].count(first) == end - start:  # the usual case: one worker
            out.append((o, first, start, end))
        else:
            i = start
            for k, same in groupby(keys[start:end]):
                j = i + len(list(same))
                out.append((o, k, i, j))
                i = j
        start = end
    return out


def _sum_runs(
    sums: list[Sums], name: str, hist: bool, runs: list[Run], values: list[Any], insert: Insert
) -> None:
    """Add each run's values to its collector's sums, under its labels (plus `insert`)."""
    for o, k, a, b in runs:
        if insert is not None:
            at, value = insert
            k = (*k[:at], value, *k[at:])
        if hist:
            sums[o].add_histograms(name, k, values[a:b])
        else:
            sums[o].add_all(name, k, values[a:b])


def _concat(parts: Iterable[list[Any]]) -> list[Any]:
    return list(chain.from_iterable(parts))


class Plan:
    """The catalog's rows for one Detail: which families are served, labelled how, read how."""

    def __init__(self, detail: Detail | None = None) -> None:
        self.detail = d = detail or Detail()
        self.rows: list[_Row] = []
        self.fleet_rows: list[tuple[MetricDef, FromFleet]] = []
        self.summed: list[str] = []  # families served from the merged sums, in catalog order
        self.names: dict[str, tuple[str, ...]] = {}  # label names of each family as served
        for m in CATALOG:
            src = m.source
            if src is None or (m.optin and not d.on(m.optin)):
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
                self.summed.append(m.name)

    def batch(
        self,
        cgs: list[tuple[CollectorView, Group]],
        dedupe: set[object] | None = None,
        memo: Memo | None = None,
    ) -> Batch:
        """The series of these collectors (in this order). `dedupe`: a seen-set shared by
        collectors whose label sets may repeat: the first copy of a series wins, and a stream
        is summed into its worker's series once. `memo`: kept by the caller from one batch to
        the next, so that label sets equal to the last batch's are the same objects."""
        scopes = _scopes(cgs)
        ids = [c.info.collector_id for c, _ in cgs]
        for sc in scopes.values():
            sc.memo, sc.ids = memo, ids
        sums = [Sums() for _ in cgs]
        columns: dict[str, Column] = {}
        for row in self.rows:
            sc = scopes[row.scope]
            if row.summed and dedupe is None:
                row.sum_into(sc, sums)
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
        return Batch(columns, sums, *_claims(scopes, len(cgs)))

    def fleet(self, v: FleetView, order: list[CollectorView], sums: Sums) -> dict[str, Column]:
        """The fleet-level series: the rows read off the whole view, and the per-worker sums."""
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
        for name in self.summed:
            labels, values = sums.series(name)
            if values:
                out[name] = Column(labels, values, [0] * len(values))
        return out


def _first_copies(row: _Row, sc: _Items, col: Column, at: list[int], seen: set[object]) -> Column:
    """The series of `col` not served yet: by label set, or for a summed row, by the stream
    (worker, node, rank) and label set it adds to (the first copy wins)."""
    if row.summed:
        streams = list(zip(*(sc.label(n) for n in STREAM), strict=True))
        keys: list[object] = [
            (row.name, streams[i], k) for i, k in zip(at, col.labels, strict=True)
        ]
    else:
        keys = [(row.name, k) for k in col.labels]
    keep = []
    for k in keys:
        keep.append(k not in seen)
        seen.add(k)
    if all(keep):
        return col
    return Column(*(list(compress(x, keep)) for x in (col.labels, col.values, col.owner)))


def _scopes(cgs: list[tuple[CollectorView, Group]]) -> dict[Scope, _Items]:
    """Every scope's items over the batch."""
    nodes = [str(c.info.node_rank) for c, _ in cgs]
    streams: list[StreamView] = _concat(g.streams for _, g in cgs)
    s_owner = _concat([i] * len(g.streams) for i, (_, g) in enumerate(cgs))
    stats = list(map(attrgetter("stats"), streams))

    def s_live() -> list[bool] | None:
        up = list(map(attrgetter("up"), streams))
        return None if all(up) else up

    st = _Items(
        streams,
        s_owner,
        {
            "worker_id": lambda: list(map(_WORKER, stats)),
            "dp_rank": lambda: list(map(str, map(_DP, stats))),
            "node_rank": lambda: list(map(nodes.__getitem__, s_owner)),
        },
        s_live,
    )
    media_lists = list(map(attrgetter("media"), stats))
    if all(len(ms) == 1 for ms in media_lists):
        media = [ms[0] for ms in media_lists]
        parent = list(range(len(media)))
    else:
        media = _concat(media_lists)
        parent = _concat([i] * len(ms) for i, ms in enumerate(media_lists))

    def via_parent(name: str) -> Callable[[], list[str]]:
        return lambda: list(map(st.label(name).__getitem__, parent))

    def m_live() -> list[bool] | None:
        up = st.live
        return None if up is None else list(map(up.__getitem__, parent))

    md = _Items(
        media,
        list(map(s_owner.__getitem__, parent)),
        {n: via_parent(n) for n in STREAM},
        m_live,
    )

    cids = [c.info.collector_id for c, _ in cgs]

    def ranked(items: list[Any], owner: list[int]) -> _Items:
        """Items that name their worker and rank, under their collector's node."""
        return _Items(
            items,
            owner,
            {
                "worker_id": lambda: list(map(_WORKER, items)),
                "dp_rank": lambda: list(map(str, map(_DP, items))),
                "node_rank": lambda: list(map(nodes.__getitem__, owner)),
            },
        )

    def per_collector(
        get: Callable[[CollectorView, Group], list[Any]],
    ) -> tuple[list[Any], list[int]]:
        parts = [get(c, g) for c, g in cgs]
        return _concat(parts), _concat([i] * len(p) for i, p in enumerate(parts))

    sched, sched_owner = per_collector(lambda c, g: g.scheduler)
    unexp, unexp_owner = per_collector(lambda c, g: g.unexpected)
    drift, drift_owner = per_collector(_drift)
    sources, src_owner = per_collector(lambda c, g: c.snapshot.drift_sources if c.up else [])
    errors, err_owner = per_collector(lambda c, g: c.snapshot.scheduler_errors)
    workers, w_owner = per_collector(lambda c, g: c.snapshot.workers)
    states, s_owner_ = per_collector(lambda c, g: c.snapshot.sources)
    binds, b_owner = per_collector(lambda c, g: c.snapshot.binds)
    up = [c.up for c, _ in cgs]

    def collectors_up(owner: list[int]) -> Callable[[], list[bool] | None]:
        return lambda: None if all(up) else list(map(up.__getitem__, owner))

    def of_collector(items: list[Any], owner: list[int]) -> _Items:
        """Items of a collector, labelled with its id and node (up while it is)."""
        made: dict[str, Callable[[], list[str]]] = {
            "collector": lambda: list(map(cids.__getitem__, owner)),
            "node_rank": lambda: list(map(nodes.__getitem__, owner)),
            "worker_id": lambda: list(map(_WORKER, items)),
            "dp_rank": lambda: list(map(str, map(_DP, items))),
        }
        return _Items(items, owner, made, collectors_up(owner))

    collectors = [c for c, _ in cgs]
    co_owner = list(range(len(cgs)))
    return {
        Scope.STREAM: st,
        Scope.MEDIUM: md,
        Scope.SCHEDULER: ranked(sched, sched_owner),
        Scope.UNEXPECTED: ranked(unexp, unexp_owner),
        Scope.DRIFT: ranked(drift, drift_owner),
        Scope.DRIFT_SOURCE: _Items(
            sources,
            src_owner,
            {
                "collector": lambda: list(map(cids.__getitem__, src_owner)),
                "worker_id": lambda: list(map(_WORKER, sources)),
            },
        ),
        Scope.COLLECTOR: _Items(
            collectors,
            co_owner,
            {
                "collector": lambda: cids,
                "node_rank": lambda: nodes,
                "hostname": lambda: [c.info.hostname for c in collectors],
            },
        ),
        Scope.WORKER: of_collector(workers, w_owner),
        Scope.SOURCE: of_collector(states, s_owner_),
        Scope.BIND: of_collector(binds, b_owner),
        Scope.SOURCE_ERROR: _Items(
            errors,
            err_owner,
            {
                "worker_id": lambda: list(map(_WORKER, errors)),
                "node_rank": lambda: list(map(nodes.__getitem__, err_owner)),
            },
        ),
    }


def _drift(c: CollectorView, g: Group) -> list[Any]:
    """A live collector's drift entries, but those of its streams that are down (their index
    no longer follows the engine: nothing to compare)."""
    drift = c.snapshot.drift
    if not drift or not c.up:
        return []
    down = {(s.stats.worker_id, s.stats.dp_rank) for s in g.streams if not s.up}
    return [d for d in drift if (d.worker_id, d.dp_rank) not in down] if down else list(drift)


# the labels that tell a scope's items apart (with those _claims adds), STREAM's by default
_IDENTITY = {
    Scope.SOURCE_ERROR: ("worker_id", "node_rank"),
    Scope.DRIFT_SOURCE: ("worker_id",),
    Scope.WORKER: ("worker_id",),
    Scope.SOURCE: ("worker_id",),
    Scope.BIND: ("worker_id", "dp_rank"),
}


def _claims(scopes: dict[Scope, _Items], n: int) -> tuple[list[frozenset[Labels]], list[bool]]:
    """Per collector of the batch: the label sets of its series that another collector's could
    repeat (those without a `collector` label: its streams', ranks' and errors'), and whether
    none of its own items repeats another (else its series are read with a seen-set)."""
    claims: list[set[Labels]] = [set() for _ in range(n)]
    clean = [True] * n
    for scope, extra in (
        (Scope.STREAM, ()),
        (Scope.MEDIUM, ("medium",)),
        (Scope.SCHEDULER, ()),
        (Scope.UNEXPECTED, ("endpoint",)),
        (Scope.DRIFT, ("medium", "method")),
        (Scope.SOURCE_ERROR, ("source", "reason")),
        (Scope.DRIFT_SOURCE, ()),
        (Scope.WORKER, ("state",)),
        (Scope.SOURCE, ("source", "state")),
        (Scope.BIND, ()),
    ):
        sc = scopes[scope]
        if not sc.items:
            continue
        names = _IDENTITY.get(scope, STREAM)
        cols = [sc.label(name) for name in names]
        full = list(zip(*cols, *(sc.label(e, e) for e in extra), strict=True))
        claim: list[Labels] | None = None  # a collector-labelled scope: no clash possible
        if scope in (Scope.STREAM, Scope.SCHEDULER, Scope.SOURCE_ERROR):
            claim = full
        elif scope in (Scope.UNEXPECTED, Scope.DRIFT):
            claim = list(zip(*cols, strict=True))
        start = 0
        for o, run in groupby(sc.owner):  # each collector's items are consecutive
            end = start + len(list(run))
            own = set(full[start:end])
            if len(own) < end - start:
                clean[o] = False
            if claim is not None:
                claims[o].update(own if claim is full else claim[start:end])
            start = end
    return [frozenset(s) for s in claims], clean
