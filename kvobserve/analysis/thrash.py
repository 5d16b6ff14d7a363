"""Recent removals of one medium of one stream: a time window of `hash -> removal ts` with a cap.

A block stored again on the same rank and medium while its removal is still in the window is a
*restore* (eviction thrash: the engine computed or loaded it again soon after throwing it away).
The dict keeps insertion order, which is removal order, so expiry pops from the front. At the
cap, new removals are refused (counted), never older ones evicted: the refusal count says how
much of the window went untracked (docs/cache-analytics.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from kvobserve.analysis.histogram import LifetimeHistogram
from kvobserve.wire.kv_events import BlockHash

DEFAULT_WINDOW_S = 300.0
DEFAULT_CAP = 4_096  # per stream and medium: ~80 B each (entry + the hash kept alive)
# seconds from removal to restore: thrash shows at the low end
RESTORE_BUCKETS: tuple[float, ...] = (
    0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
)  # fmt: skip


class RecentRemovals:
    """Removals of one medium within `window_s` (engine time), at most `cap` of them."""

    __slots__ = ("cap", "gaps", "next_expiry", "refused", "removed", "restored", "window_s")

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, cap: int = DEFAULT_CAP) -> None:
        self.window_s = window_s
        self.cap = cap
        self.removed: dict[BlockHash, float] = {}
        self.refused = 0  # removals not tracked because the cap was reached
        self.restored = 0  # blocks stored again within the window
        self.gaps = LifetimeHistogram(RESTORE_BUCKETS)  # removal -> restore seconds
        # nothing can expire before this engine time: a full window is not walked per batch
        # (a dict that restores pop from the middle is slow to walk from its front)
        self.next_expiry = 0.0

    def add(self, hashes: Sequence[BlockHash], ts: float) -> None:
        """Remember that `hashes` left at `ts` (the batch's ts object, shared by all).

        The usual case, room for all of them, is one loop: `BlockIndex` calls this for every
        removal from a top tier. A full window is expired (when anything can expire) before
        what still does not fit is refused."""
        removed = self.removed
        n = len(hashes)
        room = self.cap - len(removed)
        if room < n:
            if ts >= self.next_expiry:
                room += self.expire(ts)
            if room <= 0:
                self.refused += n
                return
            if room < n:
                self.refused += n - room
                hashes = hashes[:room]
        for h in hashes:  # a plain loop beats update(zip(...)) on 3.11's specialised opcodes
            removed[h] = ts

    def restore(self, hashes: Sequence[BlockHash], ts: float) -> BlockHash | None:
        """`hashes` are stored again at `ts`: count those removed within the window; the first
        of them (None if none)."""
        pop = self.removed.pop
        first: BlockHash | None = None
        last: float | None = None
        run = found = 0
        limit = ts - self.window_s
        gaps = self.gaps
        for h in hashes:
            at = pop(h, None)
            if at is None or at < limit:
                continue
            found += 1
            if first is None:
                first = h
            if at is last:  # removed by the same batch (one ts object): one update per run
                run += 1
                continue
            if run:
                gaps.observe(ts - last, run)  # type: ignore[operator]
            last, run = at, 1
        if run:
            gaps.observe(ts - last, run)  # type: ignore[operator]
        self.restored += found
        return first

    def expire(self, now: float) -> int:
        """Drop removals older than the window; how many were dropped."""
        removed = self.removed
        limit = now - self.window_s
        old = 0
        self.next_expiry = now + self.window_s  # empty: the next removal starts the clock
        for at in removed.values():
            if at >= limit:
                self.next_expiry = at + self.window_s
                break
            old += 1
        for h in list(islice(removed, old)):
            del removed[h]
        return old

    def clear(self) -> None:
        """Forget every removal (a clear or a restart: what follows is no restore)."""
        self.removed.clear()
        self.next_expiry = 0.0
