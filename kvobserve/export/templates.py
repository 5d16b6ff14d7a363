"""A collector's stream and scheduler lines from cached templates: only the values are formatted.

With the default series budget a stream's lines differ from one snapshot to the next only in
their values; their names, labels and which lines exist (the stream's "shape": up or not,
its media, replay results, decode-error reasons, ...) almost never change. So each collector
keeps, per shape of all its streams and scheduler ranks, one template per family with a
`%(n)s` placeholder per value; rendering is then one pass that lists the values, one
`format_value` per value and one `%` per family (C-level). Same bytes as chunks._stream and the
reference writer (export/samples.py); tests hold all three to prometheus_client's output.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter, itemgetter, methodcaller
from typing import Any

from kvobserve.analysis.fleet import StreamView
from kvobserve.export.exposition import _escape, format_value
from kvobserve.export.rollup import WorkerSums
from kvobserve.export.samples import EVENT_TYPES, SCHEDULER_FIELDS
from kvobserve.wire.snapshot import MediumStats, SchedulerStats, StreamStats

# Always written, in this order (the row families of chunks.STREAM_FAMILIES that are scalars).
_COUNTERS = (
    ("kvobserve_kv_event_batches_total", "batches_total"),
    ("kvobserve_kv_sequence_gaps_total", "gaps"),
    ("kvobserve_kv_batches_missed_total", "missed"),
    ("kvobserve_kv_batches_recovered_total", "recovered"),
    ("kvobserve_kv_batches_lost_total", "lost"),
    ("kvobserve_kv_publisher_restarts_total", "restarts"),
    ("kvobserve_kv_duplicate_batches_total", "duplicate_batches"),
    ("kvobserve_kv_rank_mismatch_batches_total", "rank_mismatch_batches"),
)
_SCALARS = attrgetter(*[attr for _, attr in _COUNTERS])
_SCHED = attrgetter(*[attr for attr, _ in SCHEDULER_FIELDS])


class Template:
    """One collector shape's lines per family, with `%s` where a value goes, and its slots."""

    __slots__ = ("families",)

    def __init__(self) -> None:
        self.families: dict[str, tuple[list[str], list[int]]] = {}

    def line(self, name: str, labels: str, slot: int | None) -> None:
        """A line of `name`; `labels` is the escaped `{...}` text, `slot` its value (None: 1)."""
        lines, slots = self.families.setdefault(name, ([], []))
        if slot is None:
            lines.append(f"{name}{labels.replace('%', '%%')} 1.0\n")
        else:
            lines.append(f"{name}{labels.replace('%', '%%')} %s\n")
            slots.append(slot)

    def built(self) -> Filled:
        """The compiled template, nothing filled in yet."""
        out = []
        for name, (lines, slots) in self.families.items():
            getter: Callable[[list[Any]], tuple[Any, ...]]
            if not slots:
                getter = _none
            elif len(slots) == 1:
                getter = _one(slots[0])
            else:
                getter = itemgetter(*slots)
            out.append((name, "".join(lines), getter))
        return Filled(out)


def _none(values: list[Any]) -> tuple[Any, ...]:
    return ()


def _one(slot: int) -> Callable[[list[Any]], tuple[Any, ...]]:
    def get(values: list[Any]) -> tuple[Any, ...]:
        return (values[slot],)

    return get


class Filled:
    """A compiled template and, per family, the values and bytes it was last filled with."""

    __slots__ = ("families", "last")

    def __init__(self, families: list[tuple[str, str, Callable[[list[Any]], tuple[Any, ...]]]]):
        self.families = families
        self.last: dict[str, tuple[tuple[Any, ...], bytes]] = {}

    def fill(self, values: list[Any]) -> dict[str, bytes]:
        """Each family's text; a family whose values did not change since the last fill is
        reused, the others get their values formatted in."""
        out = {}
        last = self.last
        fv = format_value
        for name, text, getter in self.families:
            vals = getter(values)
            hit = last.get(name)
            if hit is not None and hit[0] == vals:
                out[name] = hit[1]
                continue
            body = (text % tuple(map(fv, vals))).encode()
            last[name] = (vals, body)
            out[name] = body
        return out


def stream_values(sv: StreamView, out: list[Any]) -> tuple[object, ...]:
    """Append one stream's values to `out` (in template order); return its shape (what its
    lines depend on besides the values)."""
    st = sv.stats
    live = sv.live and st.up  # gauges are served only then (the staleness rule)
    out.append(1 if live else 0)
    out.extend(_SCALARS(st))
    interleaved = st.interleaved_batches
    if interleaved:
        out.append(interleaved)
    rk: tuple[str, ...] = ()
    dk: tuple[str, ...] = ()
    replay = st.replay_requests
    if replay:
        rk = tuple(sorted(replay)) if len(replay) > 1 else tuple(replay)
        out.extend([replay[k] for k in rk])
    decode = st.decode_errors
    if decode:
        dk = tuple(sorted(decode)) if len(decode) > 1 else tuple(decode)
        out.extend([decode[k] for k in dk])
    ident = (st.worker_id, st.dp_rank, st.endpoint, st.engine, st.topic, sv.collector.collector_id)
    media = st.media
    # the media are part of the shape even while stale: the collector's claims depend on them
    names = (media[0].medium,) if len(media) == 1 else tuple([m.medium for m in media])
    ts = st.last_batch_ts > 0
    if not live:  # counters and health only
        if ts:
            out.append(st.last_batch_ts)
        return (ident, False, interleaved > 0, rk, dk, names, ts)
    if len(media) == 1:
        m = media[0]
        out.append(m.blocks)
        out.append(m.tokens)
    else:
        out.extend([m.blocks for m in media])
        out.extend([m.tokens for m in media])
    cap = sv.capacity_tokens
    if cap:
        out.append(cap)
        out.append(sv.gpu_tokens / cap)
    out.append(1 if st.duplicate_stream else 0)
    out.append(1 if st.state_complete else 0)
    if ts:
        out.append(st.last_batch_ts)
    lag = st.lag_seconds
    if lag is not None:
        out.append(lag)
    return (ident, True, interleaved > 0, rk, dk, names, bool(cap), ts, lag is not None)


_EVENTS = attrgetter("events")
_MEDIA = attrgetter("media")
_GET = tuple(methodcaller("get", t, 0) for t in EVENT_TYPES)
_ALREADY = attrgetter("already_resident")
_STORED = attrgetter("stored_total")
_REMOVED = attrgetter("removed_total")
_LIFETIME = attrgetter("lifetime")
_EVENT_SET = frozenset(EVENT_TYPES)
_UNKNOWN = attrgetter("unknown_removed")


def add_sums(streams: list[StreamView], sums: WorkerSums) -> None:
    """The streams' block/event counters and lifetimes into the per-worker sums (as
    samples.stream adds them; counters are integers, so the order of the sum is free)."""
    by: dict[str, list[StreamStats]] = {}
    for sv in streams:
        st = sv.stats
        sts = by.get(st.worker_id)
        if sts is None:
            by[st.worker_id] = [st]
        else:
            sts.append(st)
    counter = sums.counter
    for w, sts in by.items():
        evs = list(map(_EVENTS, sts))
        for t, get in zip(EVENT_TYPES, _GET, strict=True):
            counter("kvobserve_kv_events_total", w, t, sum(map(get, evs)))
        for e in evs:
            if not e.keys() <= _EVENT_SET:
                for t in sorted(t for t in e if t not in _EVENT_SET):
                    counter("kvobserve_kv_events_total", w, t, e[t])
        counter(
            "kvobserve_kv_blocks_unchanged_total", w, "already_resident", sum(map(_ALREADY, sts))
        )
        counter("kvobserve_kv_blocks_unchanged_total", w, "not_resident", sum(map(_UNKNOWN, sts)))
        media: dict[str, list[MediumStats]] = {}
        for ms in map(_MEDIA, sts):
            for m in ms:
                got = media.get(m.medium)
                if got is None:
                    media[m.medium] = [m]
                else:
                    got.append(m)
        for medium, ms in media.items():
            counter("kvobserve_kv_blocks_stored_total", w, medium, sum(map(_STORED, ms)))
            counter("kvobserve_kv_blocks_removed_total", w, medium, sum(map(_REMOVED, ms)))
            hs = [h for h in map(_LIFETIME, ms) if h is not None]
            if hs:
                sums.histograms(w, medium, hs)


def stream_template(t: Template, shape: tuple[Any, ...], node: str, slot: int) -> int:
    """Add one stream's lines for `shape`, its values from `slot` on in stream_values' order;
    returns the next slot."""
    (w, r, endpoint, engine, topic, cid), live, interleaved, rk, dk = shape[:5]
    ew = _escape(w)
    ls = f'{{dp_rank="{r}",node_rank="{node}",worker_id="{ew}"}}'
    info = (
        f'{{collector="{_escape(cid)}",dp_rank="{r}",endpoint="{_escape(endpoint)}",'
        f'engine="{_escape(engine)}",node_rank="{node}",topic="{_escape(topic)}",worker_id="{ew}"}}'
    )
    t.line("kvobserve_stream_info", info, None)
    t.line("kvobserve_stream_up", ls, slot)
    slot += 1
    for name, _ in _COUNTERS:
        t.line(name, ls, slot)
        slot += 1
    if interleaved:
        t.line("kvobserve_kv_interleaved_batches_total", ls, slot)
        slot += 1
    for k in rk:
        labels = f'{{dp_rank="{r}",node_rank="{node}",result="{_escape(k)}",worker_id="{ew}"}}'
        t.line("kvobserve_kv_replay_requests_total", labels, slot)
        slot += 1
    for k in dk:
        labels = f'{{dp_rank="{r}",node_rank="{node}",reason="{_escape(k)}",worker_id="{ew}"}}'
        t.line("kvobserve_kv_decode_errors_total", labels, slot)
        slot += 1
    if not live:
        if shape[6]:  # its last batch's time: health, served while down
            t.line("kvobserve_kv_last_batch_timestamp_seconds", ls, slot)
            slot += 1
        return slot
    names, cap, ts, lag = shape[5:]
    media = [
        f'{{dp_rank="{r}",medium="{_escape(m)}",node_rank="{node}",worker_id="{ew}"}}'
        for m in names
    ]
    for ml in media:
        t.line("kvobserve_kv_blocks", ml, slot)
        slot += 1
    for ml in media:
        t.line("kvobserve_kv_tokens", ml, slot)
        slot += 1
    if cap:
        t.line("kvobserve_kv_capacity_tokens", ls, slot)
        t.line("kvobserve_kv_cache_usage_ratio", ls, slot + 1)
        slot += 2
    t.line("kvobserve_kv_duplicate_stream", ls, slot)
    t.line("kvobserve_kv_state_complete", ls, slot + 1)
    slot += 2
    if ts:
        t.line("kvobserve_kv_last_batch_timestamp_seconds", ls, slot)
        slot += 1
    if lag:
        t.line("kvobserve_kv_event_lag_seconds", ls, slot)
        slot += 1
    return slot


def scheduler_values(sch: SchedulerStats, out: list[Any]) -> tuple[object, ...]:
    """Append one rank's scheduler values that are set; return its shape."""
    vals = _SCHED(sch)
    present = tuple([v is not None for v in vals])
    out.extend([v for v in vals if v is not None])
    return (sch.worker_id, sch.dp_rank, present)


def scheduler_template(t: Template, shape: tuple[Any, ...], node: str, slot: int) -> int:
    """Add one rank's scheduler lines; returns the next slot."""
    w, r, present = shape
    ls = f'{{dp_rank="{r}",node_rank="{node}",worker_id="{_escape(w)}"}}'
    for (_, name), here in zip(SCHEDULER_FIELDS, present, strict=True):
        if here:
            t.line(name, ls, slot)
            slot += 1
    return slot
