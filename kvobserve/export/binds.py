"""The bind-mode samples (bound endpoints and their relays): one writer for both renderers.

export/samples.py (reference) and export/chunks.py (cached) both call `collector_samples` per
collector, as they do export/cache.py's. Gauges are served while the collector is up; counters
always (the staleness rule), the relay's drop reasons from the start so `increase()` sees the
first drop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvobserve.export.exposition import Sink
from kvobserve.wire.snapshot import RELAY_DROP_REASONS

if TYPE_CHECKING:
    from kvobserve.analysis.fleet import CollectorView


def collector_samples(f: Sink, c: CollectorView) -> None:
    """The samples of every endpoint the collector binds."""
    cid = c.info.collector_id
    for b in c.snapshot.binds:
        lb = {"collector": cid, "worker_id": b.worker_id, "dp_rank": str(b.dp_rank)}
        if c.up:
            f.add("kvobserve_bind_publishers", {**lb, "endpoint": b.endpoint}, b.publishers)
        f.add("kvobserve_bind_messages_total", lb, b.messages_total)
        for reason, n in sorted(b.skipped.items()):
            f.add("kvobserve_bind_skipped_total", {**lb, "reason": reason}, n)
        r = b.relay
        if r is None:
            continue
        if c.up:
            f.add("kvobserve_relay_up", {**lb, "target": r.target}, 1 if r.state == "up" else 0)
        f.add("kvobserve_relay_forwarded_total", lb, r.forwarded)
        for reason in RELAY_DROP_REASONS:
            f.add(
                "kvobserve_relay_dropped_total", {**lb, "reason": reason}, r.dropped.get(reason, 0)
            )
