"""Per-stream block index: resident blocks and tokens per medium, block lifetimes.

One `BlockIndex` per (worker, dp_rank) stream; `apply_batch` is the hot path (one call per
batch). Memory per resident block is one dict entry `hash -> store ts` in the medium's dict;
the store-ts float object is shared by every block of a batch, and a block's token count is
kept only when it differs from the stream's usual block size (the largest one seen), so
SGLang's short last pages cost one more small entry and everything else costs nothing extra.

Counting rules (docs/stream-semantics.md):
- `stored_total` counts blocks that became resident; a store of an already resident hash goes to
  `store_of_resident_total` and keeps the first store time.
- `removed_total` counts blocks that left by `BlockRemoved`, `AllBlocksCleared` or `TierCleared`
  (Dynamo's clear of one medium; event `kind` "TierCleared" with a `medium`), so
  `stored_total - removed_total == blocks` until a `reset()` (publisher restart), which drops
  blocks without counting them (the engine did not tell us when they left), or a `restore()`
  (a checkpoint), which brings blocks back without counting them as stored.
- Lifetime = removal ts - store ts (engine timestamps, clamped at 0), observed for removals and
  clears, not for resets.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import compress, repeat
from operator import is_not
from typing import cast

from kvobserve.analysis.analytics import CacheAnalytics
from kvobserve.analysis.histogram import LifetimeHistogram
from kvobserve.analysis.misses import RankMisses
from kvobserve.analysis.tiers import DEFAULT_MEDIUM, TOP_MEDIA, Tier
from kvobserve.wire.kv_events import BlockHash, BlockStored, KvBatch

_TOP_ORDER = (DEFAULT_MEDIUM, *sorted(TOP_MEDIA - {DEFAULT_MEDIUM}))  # where the engine computes
DEFAULT_MAX_MEDIA = 8  # storage tiers per stream; engines have 1-4 (GPU, CPU_PINNED, DISK, ...)
# seconds: prefix-cache blocks live from sub-second (evicted under pressure) to hours (system prompts)
DEFAULT_LIFETIME_BUCKETS: tuple[float, ...] = (
    0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0,
)  # fmt: skip


class BlockIndex:
    """Resident blocks of one stream, per medium, built from KV-event batches."""

    def __init__(
        self,
        lifetime_buckets: Sequence[float] = DEFAULT_LIFETIME_BUCKETS,
        max_media: int = DEFAULT_MAX_MEDIA,
    ) -> None:
        self._buckets = tuple(sorted(lifetime_buckets))
        self.max_media = max_media
        self._tiers: dict[str, Tier] = {}
        self.media_refused_events = 0  # events of a medium past max_media: label cardinality cap
        self._usual_size: int | None = None
        self.store_of_resident_total = 0
        self.remove_of_unknown_total = 0
        self.clears_total = 0  # whole-cache clears only: the sequencer treats one as a fresh start
        self.tier_clears_total = 0  # one-medium clears (Dynamo TierCleared)
        self.stored_events_total = 0
        self.removed_events_total = 0
        self.other_group_events_total = 0  # vLLM side KV-cache groups: set aside by the decoder
        # analysis/analytics.py: None = residency only, no per-event work beyond it
        self._analytics: CacheAnalytics | None = None
        self._wide = False  # several tiers (with analytics: every store may be a move)
        # analysis/misses.py: None = no miss split; else told of each top-tier store first
        self.misses: RankMisses | None = None

    def _tier(self, medium: str | None) -> Tier | None:
        name = medium or DEFAULT_MEDIUM
        tier = self._tiers.get(name)
        if tier is None:
            if len(self._tiers) >= self.max_media:  # `medium` comes off the wire: bound it
                self.media_refused_events += 1
                return None
            tier = self._tiers[name] = Tier(self._buckets, name)
            if self._analytics is not None:
                tier.thrash = self._analytics.recent_for(name)
                tier.recent = tier.thrash.removed
            self._wide = len(self._tiers) > 1
        return tier

    def apply_batch(self, batch: KvBatch) -> None:
        """Apply all events of `batch` in order; the batch ts is the time of every event."""
        ts = batch.ts  # one float object, shared by every block this batch stores
        tiers = self._tiers
        analytics = self._analytics
        if batch.other_group_events:
            self.other_group_events_total += batch.other_group_events
        for ev in batch.events:
            # the class's `kind` tells the three apart with one lookup instead of isinstance()s
            kind = ev.kind
            if kind == "BlockStored":
                tier = tiers.get(ev.medium or DEFAULT_MEDIUM)  # type: ignore[attr-defined]
                size = ev.block_size  # type: ignore[attr-defined]
                if tier is None or size != self._usual_size:
                    self._store(ev, ts)  # type: ignore[arg-type]
                    continue
                # the usual case, inlined: a known tier and the usual block size
                self.stored_events_total += 1
                hashes = ev.block_hashes  # type: ignore[attr-defined]
                resident = tier.resident
                if self.misses is not None and tier.top:
                    self.misses.on_store(tier.name, resident, hashes)
                if analytics is not None:
                    # the analytics' usual case inlined: nothing restored, moved, orphaned,
                    # attributed or held by a sibling rank means nothing to do
                    recent = tier.recent
                    parent = ev.parent_block_hash  # type: ignore[attr-defined]
                    if (
                        (recent and hashes and hashes[0] in recent)  # see CacheAnalytics.on_store
                        or (tier.top and parent is not None and parent not in resident)
                        or self._wide  # several tiers: every store may be a move
                        or analytics.peers  # sibling ranks to check
                        or ev.lora_name  # type: ignore[attr-defined]
                    ):
                        analytics.on_store(tiers, tier, ev, ts)  # type: ignore[arg-type]
                before = len(resident)
                # a resident hash keeps its first store time (3.11's specialised dict opcodes
                # make this loop faster than map(resident.setdefault, ...))
                for h in hashes:
                    if h not in resident:
                        resident[h] = ts
                added = len(resident) - before
                if added != len(hashes):
                    self.store_of_resident_total += len(hashes) - added
                tier.stored += added
                tier.tokens += added * size
            elif kind == "BlockRemoved":
                self._remove(ev.block_hashes, ev.medium, ts)  # type: ignore[attr-defined]
            elif kind == "AllBlocksCleared":
                self._clear(ts)
            elif kind == "TierCleared":
                self._clear_medium(ev.medium, ts)  # type: ignore[attr-defined]

    def _store(self, ev: BlockStored, ts: float) -> None:
        hashes, size = ev.block_hashes, ev.block_size
        tier = self._tier(ev.medium)
        if tier is None:
            return
        self.stored_events_total += 1
        if self.misses is not None and tier.top:
            self.misses.on_store(tier.name, tier.resident, hashes)
        if self._analytics is not None:
            self._analytics.on_store(self._tiers, tier, ev, ts)
        resident = tier.resident
        usual = self._usual_size
        if usual is None or size > usual:
            usual = self._raise_usual_size(size)
        before = len(resident)
        if size == usual:
            for h in hashes:
                if h not in resident:
                    resident[h] = ts
        else:
            odd = tier.odd
            for h in hashes:
                if h not in resident:
                    resident[h] = ts
                    odd[h] = size
        added = len(resident) - before
        self.store_of_resident_total += len(hashes) - added
        tier.stored += added
        tier.tokens += added * size

    def _raise_usual_size(self, size: int) -> int:
        """Make `size` the usual block size; blocks of the old usual size become explicit."""
        # The largest size seen is the page/block size; shorter ones are SGLang's last pages.
        # This runs a few times per stream at most (sizes only grow up to the page size).
        old = self._usual_size
        if old is not None:
            for tier in self._tiers.values():
                odd = tier.odd
                for h in tier.resident:
                    if h not in odd:
                        odd[h] = old
        self._usual_size = size
        return size

    def _remove(self, hashes: list[BlockHash], medium: str | None, ts: float) -> None:
        tier = self._tier(medium)
        if tier is None:
            return
        self.removed_events_total += 1
        # one C-level pass; None marks a hash that was not resident
        stored = list(map(tier.resident.pop, hashes, repeat(None)))
        n = len(stored)
        if not n:
            return
        usual = self._usual_size or 0
        first = stored[0]
        if first is not None and stored.count(first) == n:
            # the usual case: all resident, stored by one event (one ts object): one update
            tier.tokens -= sum(map(tier.odd.pop, hashes, repeat(usual))) if tier.odd else n * usual
            tier.lifetime.observe(ts - first, n)
            tier.removed += n
            if self._analytics is not None:
                self._removed(tier, hashes, stored, 0, ts)
            return
        unknown = stored.count(None)
        self.remove_of_unknown_total += unknown
        if self._analytics is not None:
            self._removed(tier, hashes, stored, unknown, ts)
        removed = n - unknown
        if not removed:
            return
        odd = tier.odd
        if odd:
            gone = compress(hashes, map(is_not, stored, repeat(None))) if unknown else hashes
            tier.tokens -= sum(map(odd.pop, gone, repeat(usual)))
        else:
            tier.tokens -= removed * usual
        present = [t for t in stored if t is not None] if unknown else cast("list[float]", stored)
        observe = tier.lifetime.observe
        for stored_at, k in Counter(present).items():
            observe(ts - stored_at, k)
        tier.removed += removed

    def _removed(
        self, tier: Tier, hashes: list[BlockHash], stored: list[float | None], unknown: int,
        ts: float,
    ) -> None:  # fmt: skip
        """Tell the analytics; the usual removal (all resident, top tier, no adapters) goes
        straight to the tier's recent removals."""
        a = self._analytics
        assert a is not None
        rec = tier.thrash
        if unknown or rec is None or not tier.top or a.lora_of:
            a.on_remove(tier, hashes, stored, unknown, ts)
        else:
            rec.add(hashes, ts)

    def _clear(self, ts: float) -> None:
        self.clears_total += 1
        if self._analytics is not None:
            self._analytics.on_clear(None)
        for tier in self._tiers.values():
            tier.clear(ts)

    def _clear_medium(self, medium: str, ts: float) -> None:
        """Drop every block of one medium (a medium never seen has nothing to drop)."""
        self.tier_clears_total += 1
        if self._analytics is not None:
            self._analytics.on_clear(medium)
        tier = self._tiers.get(medium)
        if tier is not None:
            tier.clear(ts)

    def restore(
        self,
        block_size: int,
        tiers: Iterable[tuple[str, dict[BlockHash, float], dict[BlockHash, int]]],
    ) -> None:
        """Take resident blocks back from a checkpoint (analysis/checkpoint.py) into this empty
        index: per medium, hash -> store ts (one float object per batch, as `apply_batch`
        shares them) and the token counts that differ from `block_size`. The dicts are kept,
        not copied. Counters stay at 0: a new process counts from its own start, so from here
        `stored_total - removed_total == blocks - restored blocks` (until a reset)."""
        if any(t.resident for t in self._tiers.values()):
            raise ValueError("restore: the index already holds blocks")
        self._usual_size = block_size or None
        for medium, resident, odd in tiers:
            tier = self._tier(medium)
            if tier is None:
                continue  # past max_media (the refusal is counted)
            tier.resident, tier.odd = resident, odd
            tier.tokens = (len(resident) - len(odd)) * block_size + sum(odd.values())

    def reset(self) -> None:
        """Forget every resident block (publisher restart); counters and histograms are kept."""
        if self._analytics is not None:
            self._analytics.on_clear(None)
        for tier in self._tiers.values():
            tier.resident.clear()
            tier.odd.clear()
            tier.tokens = 0
        self._usual_size = None

    @property
    def block_size(self) -> int:
        """Tokens per block of the stream's events: the usual one (0 until a store)."""
        return self._usual_size or 0

    @property
    def tiers(self) -> dict[str, Tier]:
        """Medium -> tier state, as kept (for reading: the analytics' peers, cache_stats, the miss
        split's peers)."""
        return self._tiers

    @property
    def analytics(self) -> CacheAnalytics | None:
        """The attached cache analytics (None: residency only)."""
        return self._analytics

    @analytics.setter
    def analytics(self, a: CacheAnalytics | None) -> None:
        self._analytics = a
        for name, tier in self._tiers.items():
            tier.thrash = a.recent_for(name) if a is not None else None
            tier.recent = tier.thrash.removed if tier.thrash is not None else None

    def top_resident(self) -> dict[BlockHash, float]:
        """The resident hashes of the top tier (GPU, or DEVICE) as kept: hash -> store ts;
        empty if none yet. Read it where the index is applied (the ingest thread)."""
        for name in _TOP_ORDER:
            tier = self._tiers.get(name)
            if tier is not None:
                return tier.resident
        return {}

    def leading_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """How many of `hashes`, from the first, the top tier holds now: a dictionary walk
        that stops at the first miss (docs/cache-analytics.md "Checking a router's decision")."""
        resident = self.top_resident()
        for n, h in enumerate(hashes):
            if h not in resident:
                return n
        return len(hashes)

    def resident_hashes(self) -> dict[str, set[BlockHash]]:
        """Medium -> resident hashes (a copy; for tests and ground-truth checks)."""
        return {m: set(t.resident) for m, t in self._tiers.items()}

    @property
    def blocks(self) -> dict[str, int]:
        """Resident blocks per medium (media seen once stay, at 0)."""
        return {m: len(t.resident) for m, t in self._tiers.items()}

    @property
    def tokens(self) -> dict[str, int]:
        """Resident tokens per medium."""
        return {m: t.tokens for m, t in self._tiers.items()}

    @property
    def stored_total(self) -> dict[str, int]:
        """Blocks that became resident, per medium."""
        return {m: t.stored for m, t in self._tiers.items()}

    @property
    def removed_total(self) -> dict[str, int]:
        """Blocks that left by removal or clear, per medium."""
        return {m: t.removed for m, t in self._tiers.items()}

    @property
    def lifetime(self) -> dict[str, LifetimeHistogram]:
        """Block lifetime histogram per medium."""
        return {m: t.lifetime for m, t in self._tiers.items()}

    @property
    def events_total(self) -> dict[str, int]:
        """Events by type for kvobserve_kv_events_total: `stored`, `removed`, `cleared` applied,
        and `other_group` set aside (only once there was one: vLLM hybrid models)."""
        out = {
            "stored": self.stored_events_total,
            "removed": self.removed_events_total,
            "cleared": self.clears_total + self.tier_clears_total,
        }
        if self.other_group_events_total:
            out["other_group"] = self.other_group_events_total
        return out
