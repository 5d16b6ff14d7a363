"""Storage tiers (media) of a stream's KV cache: their names and the state kept per tier.

The top tier is where the engine computes (GPU, or DEVICE on non-GPU backends); the others are
offload tiers (CPU_PINNED, DISK, ...). A `Tier` is one medium's part of a stream's `BlockIndex`
(analysis/blocks.py), which the cache analytics (analysis/analytics.py) read and extend.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvobserve.analysis.histogram import LifetimeHistogram
from kvobserve.analysis.thrash import RecentRemovals
from kvobserve.wire.kv_events import BlockHash

DEFAULT_MEDIUM = "GPU"  # a store or removal that names no medium
TOP_MEDIA = frozenset({"GPU", "DEVICE"})  # the compute tier; the others are offload tiers


class Tier:
    """State of one medium (storage tier) of one stream."""

    __slots__ = (
        "lifetime",
        "name",
        "odd",
        "recent",
        "removed",
        "resident",
        "stored",
        "thrash",
        "tokens",
        "top",
    )

    def __init__(self, buckets: Sequence[float], name: str = DEFAULT_MEDIUM) -> None:
        self.name = name
        self.top = name in TOP_MEDIA
        self.thrash: RecentRemovals | None = None  # the analytics' recent removals ...
        self.recent: dict[BlockHash, float] | None = None  # ... and their dict (one slot read)
        self.resident: dict[BlockHash, float] = {}  # hash -> store ts
        self.odd: dict[BlockHash, int] = {}  # token counts that differ from the usual block size
        self.tokens = 0
        self.stored = 0
        self.removed = 0
        self.lifetime = LifetimeHistogram(buckets)

    def clear(self, ts: float) -> None:
        """Every resident block leaves at `ts` (lifetimes observed, counted as removed)."""
        observe = self.lifetime.observe
        for stored_at, n in Counter(self.resident.values()).items():
            observe(ts - stored_at, n)
        self.removed += len(self.resident)
        self.resident.clear()
        self.odd.clear()
        self.tokens = 0
