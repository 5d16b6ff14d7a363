"""The settings of the ingest loop (sources/kv_stream.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kvobserve.analysis.analytics import DEFAULT_ANALYTICS, AnalyticsOptions
from kvobserve.analysis.capacity import DEFAULT_CURVE, CurveOptions
from kvobserve.analysis.sequence import DEFAULT_LIMITS, SequencerLimits
from kvobserve.sources.link import DEFAULT_LINK_TIMES, LinkTimes
from kvobserve.wire.kv_events import DEFAULT_MAX_PAYLOAD


@dataclass(frozen=True)
class IngestOptions:
    """Tunables of the ingest loop."""

    max_payload: int = DEFAULT_MAX_PAYLOAD
    max_concurrent_replays: int = 4
    rcvhwm: int = 100_000
    reconnect_ivl_ms: int = 100
    reconnect_ivl_max_ms: int = 5_000
    unexpected_quiet_s: float = 30.0  # a probe port counts as active this long after a batch
    tick_s: float = 0.05
    limits: SequencerLimits = DEFAULT_LIMITS
    max_streams: int = 4096  # streams (incl. probes) per collector: a label cardinality cap
    forget_after_s: float = 300.0  # bind mode: a pod (topic template) silent this long is forgotten
    rebind_s: float = 10.0  # bind mode: an endpoint that could not be bound is tried this often
    relay_wait_s: float = 5.0  # a relayed endpoint is bound once its target subscribed, or then
    link: LinkTimes = DEFAULT_LINK_TIMES
    # docs/cache-analytics.md; None = residency and sequence only (benchmarks compare both)
    analytics: AnalyticsOptions | None = DEFAULT_ANALYTICS
    # the capacity curves (docs/cache-analytics.md), with the analytics; None = off (the
    # benchmarks compare both)
    curve: CurveOptions | None = DEFAULT_CURVE
