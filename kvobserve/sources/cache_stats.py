"""The cache analytics of the ingest thread's streams in snapshot form (docs/cache-analytics.md).

Runs in the ingest thread (like `stream_state.stream_stats`): it attaches a `CacheAnalytics` to
each new stream's index, links the ranks of one worker so a store can be checked against its
sibling ranks, fills the analytics fields of each `StreamStats` and builds one
`WorkerPlacement` per worker, recomputed at most every `placement_interval_s` because it walks
every resident block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvobserve.analysis.analytics import AnalyticsOptions, CacheAnalytics
from kvobserve.analysis.blocks import BlockIndex
from kvobserve.analysis.histogram import LifetimeHistogram
from kvobserve.analysis.placement import local_placement
from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.analysis.tiers import TOP_MEDIA
from kvobserve.engines import profile
from kvobserve.wire.snapshot import Histogram, HotBlock, StreamStats, WorkerPlacement


def attach(seq: StreamSequencer, options: AnalyticsOptions) -> CacheAnalytics:
    """Give the stream's index its analytics, bound to the sequencer's trust state."""
    a = seq.index.analytics = CacheAnalytics(options, seq.trust)
    return a


def link_peers(streams: Iterable[tuple[str, StreamSequencer]]) -> None:
    """Let every stream check its stores against the other ranks of its worker."""
    by_worker: dict[str, list[BlockIndex]] = {}
    for worker_id, seq in streams:
        by_worker.setdefault(worker_id, []).append(seq.index)
    for indexes in by_worker.values():
        for idx in indexes:
            if idx.analytics is not None:
                idx.analytics.peers = [o.tiers for o in indexes if o is not idx]


def fill_stream(
    s: StreamStats, seq: StreamSequencer, holders: Sequence[BlockIndex], wall: float = 0.0
) -> None:
    """Add the analytics fields to a built `StreamStats` (and its media) in place; `wall` is
    the collector's wall clock (when new silent-loss evidence was first reported)."""
    s.trust, s.trust_reason = seq.trust.state, seq.trust.reason
    a = seq.index.analytics
    if a is None:
        return
    s.silent_loss = {k: v for k, v in a.silent_loss.items() if v}
    total = sum(a.silent_loss.values())
    if total != a.silent_seen[0]:
        a.silent_seen = (total, wall)
    s.last_silent_loss_time = a.silent_seen[1]
    s.restore_refused = a.restore_refused
    s.recomputed_elsewhere = a.recomputed_elsewhere
    s.lora_refused = a.lora_refused
    tops = [i.top_resident() for i in holders]
    s.hot = [
        HotBlock(h, n, sum(1 for t in tops if h in t)) for h, n in a.hot.top(a.options.hot_top)
    ]
    s.hot_error = a.hot.offset
    for m in s.media:
        rec = a.recent.get(m.medium)
        if rec is not None and rec.restored:
            m.restored_total = rec.restored
            m.restore_gap = _histogram(rec.gaps)
        m.moved_in = {src: n for (src, dst), n in a.moves.items() if dst == m.medium and n}
        m.unread_removed_total = a.unread_removed.get(m.medium, 0)
        if m.medium not in TOP_MEDIA:  # read-back hashes leave the set when they leave the tier
            m.unread_blocks = m.blocks - len(a.read_back.get(m.medium, ()))
        m.lora_blocks = dict(a.lora_blocks.get(m.medium, {}))


def _histogram(h: LifetimeHistogram) -> Histogram:
    cum = h.cumulative()[:-1]  # +Inf is `count`
    return Histogram([b for b, _ in cum], [c for _, c in cum], h.count, h.sum)


class Placements:
    """Per worker, the last `WorkerPlacement` and when it was computed (monotonic seconds)."""

    def __init__(self, options: AnalyticsOptions) -> None:
        self.options = options
        self._last: dict[str, WorkerPlacement] = {}

    def build(
        self,
        streams: Iterable[tuple[str, int, str, StreamSequencer]],
        whole: frozenset[str],
        now: float,
    ) -> list[WorkerPlacement]:
        """One placement per worker of `streams` (worker, rank, engine, sequencer)."""
        by_worker: dict[str, list[tuple[int, str, StreamSequencer]]] = {}
        for worker_id, rank, engine, seq in streams:
            by_worker.setdefault(worker_id, []).append((rank, engine, seq))
        out: list[WorkerPlacement] = []
        interval = self.options.placement_interval_s
        for worker_id, ranks in sorted(by_worker.items()):
            last = self._last.get(worker_id)
            if last is not None and now - last.computed_at < interval:
                out.append(last)
                continue
            recomputed = sum(
                s.index.analytics.recomputed_elsewhere for _, _, s in ranks if s.index.analytics
            )
            p = local_placement(
                worker_id,
                {r: s.index.top_resident() for r, _, s in ranks},
                k=self.options.sketch_k,
                signed=profile(ranks[0][1]).signed_hashes,
                sketch=worker_id not in whole,
                now=now,
                recomputed_elsewhere=recomputed,
            )
            self._last[worker_id] = p
            out.append(p)
        for gone in self._last.keys() - by_worker.keys():
            del self._last[gone]
        return out
