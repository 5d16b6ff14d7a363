"""One collector's sample lines, written directly: the same text export/samples.py produces.

A chunk depends only on the collector's snapshot, whether it is up, each stream's capacity and
the scheduler entries of its ranks (joined per rank from whichever collector read them);
export/scrape.py keys its cache on exactly that. A collector whose own label sets repeat is left to the reference writer (None here).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from prometheus_client.utils import floatToGoString

from kvobserve import __version__
from kvobserve.analysis.fleet import CollectorView, FleetView, StreamView
from kvobserve.export import binds, cache
from kvobserve.export import templates as templates_mod
from kvobserve.export.exposition import TextFamilies, _escape, format_value
from kvobserve.export.rollup import COUNTER_LABEL, LIFETIME, WorkerSums
from kvobserve.export.samples import EVENT_TYPES, SCHEDULER_FIELDS, Detail, Group, configured

Claims = frozenset[tuple[str, ...]]


@dataclass
class Chunk:
    """A collector's sample lines per family, its per-worker sums and the label sets it claims."""

    text: dict[str, bytes]
    sums: WorkerSums
    claims: Claims
    gz: dict[str, bytes] = field(default_factory=dict)  # family -> deflate segment, when asked


# Memoised: the same few worker ids, media, reasons and bucket bounds come back every scrape.
_e = functools.lru_cache(maxsize=100_000)(_escape)
_le = functools.lru_cache(maxsize=10_000)(floatToGoString)


def claims(c: CollectorView, g: Group) -> tuple[Claims, bool]:
    """(the label sets its samples can share with another collector's, whether none repeats)."""
    node = str(c.info.node_rank)
    streams = {("s", s.stats.worker_id, node, str(s.stats.dp_rank)) for s in g.streams}
    sched = {("s", x.worker_id, node, str(x.dp_rank)) for x in g.scheduler}
    unexpected = {(u.worker_id, u.dp_rank, u.endpoint) for u in g.unexpected}
    errors = {("e", e.worker_id, node, e.source, e.reason) for e in c.snapshot.scheduler_errors}
    clean = (
        len(streams) == len(g.streams)
        and len(sched) == len(g.scheduler)
        and len(unexpected) == len(g.unexpected)
        and len(errors) == len(c.snapshot.scheduler_errors)
        and all(len({m.medium for m in s.stats.media}) == len(s.stats.media) for s in g.streams)
    )
    extra = {("s", w, node, str(r)) for w, r, _ in unexpected}
    drift = {("s", d.worker_id, node, str(d.dp_rank)) for d in c.snapshot.drift}
    return frozenset(streams | sched | errors | extra | drift), clean


class _Lines:
    """Sample lines per family, in the order they are added."""

    __slots__ = ("out",)

    def __init__(self) -> None:
        self.out: dict[str, list[str]] = {}

    def __call__(self, name: str, labels: str, value: str) -> None:
        """One line: `labels` is the `{...}` text and its trailing space."""
        lines = self.out.get(name)
        if lines is None:
            lines = self.out[name] = []
        lines.append(f"{name}{labels}{value}\n")


# collector id -> (shape, its template, its claims; None: its own label sets repeat)
Templates = dict[str, tuple[tuple[object, ...], "templates_mod.Filled", Claims | None]]


def render(
    c: CollectorView, g: Group, detail: Detail, templates: Templates | None = None
) -> Chunk | None:
    """The collector's chunk, or None when the reference writer must handle it.

    With the default budget and a `templates` cache, streams and scheduler ranks are written
    from the collector's templates (export/templates.py), else line by line.
    """
    i = c.info
    node = str(i.node_rank)
    templated = templates is not None and not detail.histograms and not detail.counters
    sums = WorkerSums()
    if templates is not None and templated:
        found = _templated(c, g, node, sums, templates)
        if found is None:
            return None
        text, cl = found
    else:
        cl, clean = claims(c, g)
        if not clean:
            return None
    fv = format_value
    cid = _e(i.collector_id)
    sh = f',shard="{_e(detail.shard)}"' if detail.shard else ""  # sorts after all but `what`
    add = _Lines()
    up = f'{{collector="{cid}",hostname="{_e(i.hostname)}",node_rank="{node}"{sh}}} '
    add("kvobserve_collector_up", up, "1.0" if c.up else "0.0")
    cl_ = f'{{collector="{cid}"{sh}}} '
    if i.start_time > 0:
        add("kvobserve_collector_start_time_seconds", cl_, fv(i.start_time))
    for e in c.snapshot.scheduler_errors:
        ls = (
            f'{{node_rank="{node}",reason="{_e(e.reason)}",source="{_e(e.source)}",'
            f'worker_id="{_e(e.worker_id)}"}} '
        )
        add("kvobserve_scheduler_source_errors_total", ls, fv(e.count))
    for what, n in sorted(c.snapshot.refused.items()):
        ls = f'{{collector="{cid}"{sh},what="{_e(what)}"}} '
        add("kvobserve_collector_refused_total", ls, fv(n))
    k = c.snapshot.counters
    if k is not None:
        add("kvobserve_collector_messages_received_total", cl_, fv(k.messages_received))
        add("kvobserve_collector_ingest_errors_total", cl_, fv(k.ingest_errors))
        for reason, n in sorted(k.publish_dropped.items()):
            ls = f'{{collector="{cid}",reason="{_e(reason)}"{sh}}} '
            add("kvobserve_collector_publish_dropped_total", ls, fv(n))
    if templated:
        rows: list[tuple[str, ...]] = []
        hist = None
    else:
        text = {}
        hist = TextFamilies() if detail.histograms else None
        rows = [_stream(s, node, sums, detail, hist) for s in g.streams]
    for u in g.unexpected:
        ls = (
            f'{{dp_rank="{u.dp_rank}",endpoint="{_e(u.endpoint)}",node_rank="{node}",'
            f'worker_id="{_e(u.worker_id)}"}} '
        )
        add("kvobserve_kv_unexpected_stream", ls, "1.0" if u.active else "0.0")
    for sch in () if templated else g.scheduler:  # templated: already written
        ls = f'{{dp_rank="{sch.dp_rank}",node_rank="{node}",worker_id="{_e(sch.worker_id)}"}} '
        for attr, name in SCHEDULER_FIELDS:
            val = getattr(sch, attr)
            if val is not None:
                add(name, ls, fv(val))
    text.update({name: "".join(lines).encode() for name, lines in add.out.items()})
    for name, column in zip(STREAM_FAMILIES, zip(*rows, strict=True), strict=False):
        joined = "".join(column)
        if joined:
            text[name] = joined.encode()
    if hist is not None and hist.lines[LIFETIME]:
        text[LIFETIME] = "".join(hist.lines[LIFETIME]).encode()
    own = TextFamilies()  # few lines: the reference writer's own, so the bytes agree
    cache.collector_samples(own, c, g.streams, sums, detail.counters, detail.shard)
    configured(own, c)
    binds.collector_samples(own, c)
    text.update(own.chunks())
    return Chunk(text, sums, cl)


def _templated(
    c: CollectorView, g: Group, node: str, sums: WorkerSums, templates: Templates
) -> tuple[dict[str, bytes], Claims] | None:
    """The stream and scheduler families of the collector from its template for this shape,
    and its claims; None when its own label sets repeat (claims, worked out per shape)."""
    values: list[object] = []
    templates_mod.add_sums(g.streams, sums)
    shape = (
        node,
        tuple([templates_mod.stream_values(s, values) for s in g.streams]),
        tuple([templates_mod.scheduler_values(x, values) for x in g.scheduler]),
        tuple([(u.worker_id, u.dp_rank, u.endpoint) for u in g.unexpected]),
        tuple([(e.worker_id, e.source, e.reason) for e in c.snapshot.scheduler_errors]),
    )
    cid = c.info.collector_id
    hit = templates.get(cid)
    if hit is None or hit[0] != shape:
        cl, clean = claims(c, g)
        t = templates_mod.Template()
        slot = 0
        for one in shape[1]:
            slot = templates_mod.stream_template(t, one, node, slot)
        for one in shape[2]:
            slot = templates_mod.scheduler_template(t, one, node, slot)
        hit = templates[cid] = (shape, t.built(), cl if clean else None)
    if hit[2] is None:
        return None
    return hit[1].fill(values), hit[2]


# The families of one stream's row, in the order _stream returns them.
STREAM_FAMILIES = (
    "kvobserve_stream_info",
    "kvobserve_stream_up",
    "kvobserve_kv_event_batches_total",
    "kvobserve_kv_events_total",
    "kvobserve_kv_sequence_gaps_total",
    "kvobserve_kv_batches_missed_total",
    "kvobserve_kv_batches_recovered_total",
    "kvobserve_kv_batches_lost_total",
    "kvobserve_kv_replay_requests_total",
    "kvobserve_kv_publisher_restarts_total",
    "kvobserve_kv_duplicate_batches_total",
    "kvobserve_kv_rank_mismatch_batches_total",
    "kvobserve_kv_interleaved_batches_total",
    "kvobserve_kv_blocks_unchanged_total",
    "kvobserve_kv_decode_errors_total",
    "kvobserve_kv_blocks_stored_total",
    "kvobserve_kv_blocks_removed_total",
    "kvobserve_kv_blocks",
    "kvobserve_kv_tokens",
    "kvobserve_kv_capacity_tokens",
    "kvobserve_kv_cache_usage_ratio",
    "kvobserve_kv_duplicate_stream",
    "kvobserve_kv_state_complete",
    "kvobserve_kv_last_batch_timestamp_seconds",
    "kvobserve_kv_event_lag_seconds",
)


def _stream(
    sv: StreamView, node: str, sums: WorkerSums, detail: Detail, hist: TextFamilies | None
) -> tuple[str, ...]:
    """One stream's lines, one string per STREAM_FAMILIES entry ("" when it has none).

    Mirrors samples.stream; tests hold the two to the same bytes. A row of f-strings and one
    transpose per collector costs a fraction of a function call per line.
    """
    fv = format_value
    st = sv.stats
    w, ew, r = st.worker_id, _e(st.worker_id), st.dp_rank
    ls = f'{{dp_rank="{r}",node_rank="{node}",worker_id="{ew}"}} '
    info = (
        f'kvobserve_stream_info{{collector="{_e(sv.collector.collector_id)}",dp_rank="{r}",'
        f'endpoint="{_e(st.endpoint)}",engine="{_e(st.engine)}",node_rank="{node}",'
        f'topic="{_e(st.topic)}",worker_id="{ew}"}} 1.0\n'
    )
    events = st.events
    types = [*EVENT_TYPES, *sorted(t for t in events if t not in EVENT_TYPES)]
    ev = stored = removed = ""
    if detail.counters:
        ev = "".join(
            f'kvobserve_kv_events_total{{dp_rank="{r}",node_rank="{node}",type="{_e(t)}",'
            f'worker_id="{ew}"}} {fv(events.get(t, 0))}\n'
            for t in types
        )
    else:
        for t in types:
            sums.counter("kvobserve_kv_events_total", w, t, events.get(t, 0))
    kinds = (("already_resident", st.already_resident), ("not_resident", st.unknown_removed))
    unchanged = ""
    if detail.counters:
        unchanged = "".join(
            f'kvobserve_kv_blocks_unchanged_total{{dp_rank="{r}",kind="{k}",node_rank="{node}",'
            f'worker_id="{ew}"}} {fv(n)}\n'
            for k, n in kinds
        )
    else:
        for k, n in kinds:
            sums.counter("kvobserve_kv_blocks_unchanged_total", w, k, n)
    replay = "".join(
        f'kvobserve_kv_replay_requests_total{{dp_rank="{r}",node_rank="{node}",'
        f'result="{_e(k)}",worker_id="{ew}"}} {fv(n)}\n'
        for k, n in sorted(st.replay_requests.items())
    )
    decode = "".join(
        f'kvobserve_kv_decode_errors_total{{dp_rank="{r}",node_rank="{node}",'
        f'reason="{_e(k)}",worker_id="{ew}"}} {fv(n)}\n'
        for k, n in sorted(st.decode_errors.items())
    )
    media = [
        (m, f'{{dp_rank="{r}",medium="{_e(m.medium)}",node_rank="{node}",worker_id="{ew}"}} ')
        for m in st.media
    ]
    if detail.counters:
        stored = "".join(
            f"kvobserve_kv_blocks_stored_total{ml}{fv(m.stored_total)}\n" for m, ml in media
        )
        removed = "".join(
            f"kvobserve_kv_blocks_removed_total{ml}{fv(m.removed_total)}\n" for m, ml in media
        )
    for m in st.media:
        if not detail.counters:
            sums.counter("kvobserve_kv_blocks_stored_total", w, m.medium, m.stored_total)
            sums.counter("kvobserve_kv_blocks_removed_total", w, m.medium, m.removed_total)
        if m.lifetime is None:
            continue
        if hist is not None:
            labels = {"worker_id": w, "node_rank": node, "dp_rank": str(r), "medium": m.medium}
            hist.histogram(LIFETIME, labels, m.lifetime)
        else:
            sums.histogram(w, m.medium, m.lifetime)
    head = (
        info,
        f"kvobserve_stream_up{ls}{'1.0' if sv.up else '0.0'}\n",
        f"kvobserve_kv_event_batches_total{ls}{fv(st.batches_total)}\n",
        ev,
        f"kvobserve_kv_sequence_gaps_total{ls}{fv(st.gaps)}\n",
        f"kvobserve_kv_batches_missed_total{ls}{fv(st.missed)}\n",
        f"kvobserve_kv_batches_recovered_total{ls}{fv(st.recovered)}\n",
        f"kvobserve_kv_batches_lost_total{ls}{fv(st.lost)}\n",
        replay,
        f"kvobserve_kv_publisher_restarts_total{ls}{fv(st.restarts)}\n",
        f"kvobserve_kv_duplicate_batches_total{ls}{fv(st.duplicate_batches)}\n",
        f"kvobserve_kv_rank_mismatch_batches_total{ls}{fv(st.rank_mismatch_batches)}\n",
        f"kvobserve_kv_interleaved_batches_total{ls}{fv(st.interleaved_batches)}\n"
        if st.interleaved_batches
        else "",
        unchanged,
        decode,
        stored,
        removed,
    )
    ts = (
        f"kvobserve_kv_last_batch_timestamp_seconds{ls}{fv(st.last_batch_ts)}\n"
        if st.last_batch_ts > 0
        else ""
    )
    if not sv.up:
        return (*head, "", "", "", "", "", "", ts, "")
    usage = sv.usage_ratio
    return (
        *head,
        "".join(f"kvobserve_kv_blocks{ml}{fv(m.blocks)}\n" for m, ml in media),
        "".join(f"kvobserve_kv_tokens{ml}{fv(m.tokens)}\n" for m, ml in media),
        f"kvobserve_kv_capacity_tokens{ls}{fv(sv.capacity_tokens)}\n" if sv.capacity_tokens else "",
        f"kvobserve_kv_cache_usage_ratio{ls}{fv(usage)}\n" if usage is not None else "",
        f"kvobserve_kv_duplicate_stream{ls}{'1.0' if st.duplicate_stream else '0.0'}\n",
        f"kvobserve_kv_state_complete{ls}{'1.0' if st.state_complete else '0.0'}\n",
        ts,
        f"kvobserve_kv_event_lag_seconds{ls}{fv(st.lag_seconds)}\n"
        if st.lag_seconds is not None
        else "",
    )


# (worker, its ranks' owner counts) -> the worker's kvobserve_dp_rank_owners lines; they rarely
# change, and a fleet has up to a few thousand workers (cleared past 100,000 entries)
_OWNERS: dict[tuple[str, tuple[tuple[int, int], ...]], str] = {}


def fleet_level(
    v: FleetView,
    order: list[CollectorView],
    sums: WorkerSums,
    shard: str = "",
    cache_detail: bool = False,
) -> dict[str, bytes]:
    """samples.fleet_level's lines per family, written directly (rebuilt every scrape)."""
    fv = format_value
    add = _Lines()
    sh = f',shard="{_e(shard)}"' if shard else ""
    first = f'shard="{_e(shard)}",' if shard else ""
    add("kvobserve_build_info", f'{{{first}version="{_e(__version__)}"}} ', "1.0")
    for c in order:
        cl = f'{{collector="{_e(c.info.collector_id)}"{sh}}} '
        add("kvobserve_collector_snapshot_age_seconds", cl, fv(c.age_s))
    for w_id, size in sorted(v.dp_size.items()):
        add("kvobserve_worker_dp_size", f'{{worker_id="{_e(w_id)}"}} ', fv(size))
    for w_id, ids in sorted(v.leaders.items()):
        add("kvobserve_worker_leaders", f'{{worker_id="{_e(w_id)}"}} ', fv(len(ids)))
    by_worker: dict[str, list[tuple[int, int]]] = {}
    for (w_id, rank), ids in v.owners.items():
        got = by_worker.get(w_id)
        if got is None:
            by_worker[w_id] = [(rank, len(ids))]
        else:
            got.append((rank, len(ids)))
    owners = []
    for w_id in sorted(by_worker):
        key = (w_id, tuple(sorted(by_worker[w_id])))
        text = _OWNERS.get(key)
        if text is None:
            ew = _e(w_id)
            text = "".join(
                f'kvobserve_dp_rank_owners{{dp_rank="{r}",worker_id="{ew}"}} {fv(n)}\n'
                for r, n in key[1]
            )
            if len(_OWNERS) > 100_000:
                _OWNERS.clear()
            _OWNERS[key] = text
        owners.append(text)
    for (w_id, rank), c in sorted(v.last_owner.items()):
        i = c.info
        owner = (f'{{collector="{_e(i.collector_id)}",dp_rank="{rank}",'
                 f'node_rank="{i.node_rank}",worker_id="{_e(w_id)}"}} ')  # fmt: skip
        add("kvobserve_dp_rank_last_owner_info", owner, "1.0")
    for (name, w_id, lv), n in sorted(sums.counters.items()):
        add(name, f'{{{COUNTER_LABEL[name]}="{_e(lv)}",worker_id="{_e(w_id)}"}} ', fv(n))
    out = {name: "".join(lines).encode() for name, lines in add.out.items()}
    if owners:
        out["kvobserve_dp_rank_owners"] = "".join(owners).encode()
    hist = []
    for labels, h in sums.histogram_samples():
        medium, w_id = labels["medium"], labels["worker_id"]
        tail = f'",medium="{_e(medium)}",worker_id="{_e(w_id)}"}} '
        for bound, n in zip(h.bounds, h.counts, strict=True):
            hist.append(f'{LIFETIME}_bucket{{le="{_le(bound)}{tail}{fv(n)}\n')
        ls = f'{{medium="{_e(medium)}",worker_id="{_e(w_id)}"}} '
        top = fv(h.count)
        hist.append(f'{LIFETIME}_bucket{{le="+Inf{tail}{top}\n')
        hist.append(f"{LIFETIME}_count{ls}{top}\n{LIFETIME}_sum{ls}{fv(h.sum)}\n")
    if hist:
        out[LIFETIME] = "".join(hist).encode()
    own = TextFamilies()  # per worker: a few series each (export/cache.py)
    cache.fleet_samples(own, v, sums.cache, cache_detail)
    out.update(own.chunks())
    return out
