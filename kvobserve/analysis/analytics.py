"""What one stream's events say about its cache beyond residency (docs/cache-analytics.md).

`BlockIndex` calls these hooks when a `CacheAnalytics` is attached (`index.analytics`); with none
attached it does no extra work (the switch that `benchmarks/ingest.py` compares against).
Per event, the usual case costs a few dict lookups and C-level `isdisjoint` passes; per-hash
Python work happens only for what is found (a restore, a tier move, a LoRA block, evidence).

- silent loss: while the trust state is not partial, a removal of a hash that is neither resident
  nor recently removed, and a top-tier store whose parent is neither resident, nor recently
  removed, nor a root marker, are evidence of lost events (`silent_loss` by reason);
- restores (thrash) per medium (analysis/thrash.py);
- tier moves: a store on medium B of a hash resident on, or recently removed from, medium A
  (`moves[(A, B)]`); top-tier stores of hashes resident on a lower tier mark them read back, and
  lower-tier blocks removed without being read back are counted (`unread_removed`);
- stores of blocks resident on another rank of the same worker in this collector
  (`recomputed_elsewhere`), resident blocks per LoRA adapter (capped names), and hot prefixes
  (analysis/hot.py): the blocks most often computed again although the worker had held them (a
  top-tier restore or a recompute elsewhere counts the first such block of the event).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat

from kvobserve.analysis.hot import DEFAULT_CAPACITY, DEFAULT_TOP, HotBlocks
from kvobserve.analysis.thrash import DEFAULT_CAP, DEFAULT_WINDOW_S, RecentRemovals
from kvobserve.analysis.tiers import TOP_MEDIA, Tier
from kvobserve.analysis.trust import Trust
from kvobserve.wire.kv_events import BlockHash, BlockStored

# parents that name the radix root, not a block: SGLang 0.4 sends hash(()) of the root's empty key
ROOT_PARENTS = frozenset({5740354900026072187})
LORA_OTHER = "_other"  # adapters past the name cap share this bucket
REMOVE_UNKNOWN = "remove_unknown"
PARENT_UNKNOWN = "parent_unknown"


@dataclass(frozen=True, slots=True)
class AnalyticsOptions:
    """Tunables of the per-stream analytics (the defaults are the documented ones)."""

    restore_window_s: float = DEFAULT_WINDOW_S
    restore_cap: int = DEFAULT_CAP
    move_window_s: float = 1.0  # a removal this recent on another medium makes a store a move
    max_lora_names: int = 16
    hot_capacity: int = DEFAULT_CAPACITY
    hot_top: int = DEFAULT_TOP
    placement_interval_s: float = 10.0
    sketch_k: int = 1024

    def __post_init__(self) -> None:
        for name in ("restore_cap", "max_lora_names", "hot_capacity", "hot_top", "sketch_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"analytics.{name}={getattr(self, name)}: must be >= 1")
        if self.restore_window_s <= 0 or self.placement_interval_s < 0 or self.move_window_s < 0:
            raise ValueError(
                "analytics: restore_window_s must be > 0, placement_interval_s and "
                "move_window_s >= 0"
            )


class CacheAnalytics:
    """The analytics of one stream; `trust` is its sequencer's trust state."""

    def __init__(self, options: AnalyticsOptions | None = None, trust: Trust | None = None):
        self.options = o = options or AnalyticsOptions()
        self.trust = trust or Trust()
        self.silent_loss = {REMOVE_UNKNOWN: 0, PARENT_UNKNOWN: 0}
        self.silent_seen = (0, 0.0)  # (evidence total, wall time it last grew): for snapshots
        self.recent: dict[str, RecentRemovals] = {}
        self.moves: dict[tuple[str, str], int] = {}
        self.read_back: dict[str, set[BlockHash]] = {}  # lower-tier hashes loaded back up
        self.unread_removed: dict[str, int] = {}
        self.lora_of: dict[str, dict[BlockHash, str]] = {}  # medium -> LoRA blocks only
        self.lora_blocks: dict[str, dict[str, int]] = {}
        self._lora_names: dict[str, str] = {}  # one str object per name, however many blocks
        self.lora_refused = 0  # stores whose adapter name was past the cap
        self.hot = HotBlocks(o.hot_capacity)
        self.peers: list[dict[str, Tier]] = []  # other ranks' tiers (same worker and collector)
        self.recomputed_elsewhere = 0
        # no silent-loss evidence before this engine time: after a resume from a checkpoint the
        # recent removals of the last window are not known (`resumed`)
        self.quiet_until = 0.0

    def _recent(self, medium: str) -> RecentRemovals:
        rec = self.recent.get(medium)
        if rec is None:
            o = self.options
            rec = self.recent[medium] = RecentRemovals(o.restore_window_s, o.restore_cap)
        return rec

    def recent_for(self, medium: str) -> RecentRemovals:
        """The recent removals of `medium` (BlockIndex keeps them on the tier: one slot read)."""
        return self._recent(medium)

    # --- hooks (BlockIndex calls these) ---------------------------------------------------------

    def on_store(self, tiers: dict[str, Tier], tier: Tier, ev: BlockStored, ts: float) -> None:
        """Before `ev` (a BlockStored) is applied to `tier`."""
        hashes = ev.block_hashes
        if not hashes:
            return
        name = tier.name
        top = name in TOP_MEDIA
        rec = self.recent.get(name)
        # Both engines evict the top tier leaf-first (SGLang radix leaves, vLLM a request's tail
        # blocks first; an ancestor is freed no earlier than its descendants), so a run whose
        # first block was not removed recently restores nothing: one lookup instead of one per
        # block. Lower tiers evict by their own order (LRU pages): every block is looked up.
        if rec is not None and (
            hashes[0] in rec.removed if top else not rec.removed.keys().isdisjoint(hashes)
        ):
            first = rec.restore(hashes, ts)
            if first is not None and top:
                self.hot.add(first)  # where the recomputation began
        if top:
            parent = ev.parent_block_hash
            if parent is not None and parent not in tier.resident and ts >= self.quiet_until:
                self._orphan(parent, name)
            if self.peers:
                self._elsewhere(name, tier.resident, hashes)
        if len(tiers) > 1:
            self._moves(tiers, tier, hashes, ts)
        lora = getattr(ev, "lora_name", None)
        if lora:
            self._lora_store(name, tier.resident, hashes, lora)

    def on_remove(
        self,
        tier: Tier,
        hashes: list[BlockHash],
        stored: list[float | None],
        unknown: int,
        ts: float,
    ) -> None:
        """After `hashes` were popped from `tier` (`stored[i]` None: it was not resident)."""
        name = tier.name
        rec = self._recent(name)
        gone = hashes
        if unknown:
            if self.trust.trusted and ts >= self.quiet_until:
                known = rec.removed  # a second removal of a hash (vLLM keeps duplicate copies)
                if known and not known.keys().isdisjoint(hashes):
                    unknown = sum(
                        1
                        for h, s in zip(hashes, stored, strict=True)
                        if s is None and h not in known
                    )
                self.silent_loss[REMOVE_UNKNOWN] += unknown
            if len(stored) == stored.count(None):
                return  # nothing was resident: nothing left
            gone = [h for h, s in zip(hashes, stored, strict=True) if s is not None]
        rec.add(gone, ts)
        if self.lora_of:
            lo = self.lora_of.get(name)
            if lo:
                self._lora_remove(name, lo, gone)
        if name not in TOP_MEDIA:
            self._lower_removed(name, gone)

    def _lower_removed(self, medium: str, gone: list[BlockHash]) -> None:
        rb = self.read_back.get(medium)
        read = 0
        if rb:
            read = sum(1 for h in gone if h in rb)
            rb.difference_update(gone)
        self.unread_removed[medium] = self.unread_removed.get(medium, 0) + len(gone) - read

    def on_clear(self, medium: str | None) -> None:
        """Every block of `medium` (None: of every medium) left by a clear or a reset."""
        for table in (self.recent, self.lora_of, self.read_back):
            for m, v in table.items():
                if medium is None or m == medium:
                    v.clear()
        for m, counts in self.lora_blocks.items():
            if medium is None or m == medium:
                counts.clear()

    def resumed(self, ts: float) -> None:
        """The index was restored from a checkpoint whose last batch has engine time `ts`: the
        removals of the window before it are not known, so for one restore window a removal
        of a hash removed once already (vLLM's duplicate copies) or a parent evicted just before
        would look like lost events; no silent-loss evidence is counted until then."""
        self.quiet_until = ts + self.options.restore_window_s

    def restore_lora(self, medium: str, blocks: dict[str, list[BlockHash]]) -> None:
        """Resident LoRA blocks of `medium` by adapter name, from a checkpoint (the name cap
        applies as it does to stores)."""
        for lora, hashes in blocks.items():
            name = self._lora_names.get(lora)
            if name is None:
                if len(self._lora_names) < self.options.max_lora_names:
                    name = self._lora_names[lora] = lora
                else:
                    name = LORA_OTHER
            self.lora_of.setdefault(medium, {}).update(zip(hashes, repeat(name)))
            counts = self.lora_blocks.setdefault(medium, {})
            counts[name] = counts.get(name, 0) + len(hashes)

    # --- the less usual paths -----------------------------------------------------------------

    def _orphan(self, parent: BlockHash, medium: str) -> None:
        """A top-tier store whose parent is not resident: evidence unless it can be explained."""
        if parent in ROOT_PARENTS or not self.trust.trusted:
            return
        rec = self.recent.get(medium)
        if rec is not None and parent in rec.removed:
            return  # evicted (vLLM may evict a parent whose duplicate copy the request holds)
        self.silent_loss[PARENT_UNKNOWN] += 1

    def _elsewhere(
        self, medium: str, resident: dict[BlockHash, float], hashes: list[BlockHash]
    ) -> None:
        others = [t.resident for p in self.peers if (t := p.get(medium)) is not None and t.resident]
        if others and not all(o.keys().isdisjoint(hashes) for o in others):
            again = [h for h in hashes if h not in resident and any(h in o for o in others)]
            if again:
                self.recomputed_elsewhere += len(again)
                self.hot.add(again[0])

    def _moves(
        self, tiers: dict[str, Tier], tier: Tier, hashes: list[BlockHash], ts: float
    ) -> None:
        name = tier.name
        window = self.options.move_window_s
        for src in tiers.values():
            if src is tier:
                continue
            res = src.resident
            rec = self.recent.get(src.name) if window > 0 else None
            gone = rec.removed if rec is not None else {}
            if res.keys().isdisjoint(hashes) and (not gone or gone.keys().isdisjoint(hashes)):
                continue
            since = ts - window
            moved = [h for h in hashes if h in res or gone.get(h, since - 1) >= since]
            if not moved:
                continue
            key = (src.name, name)
            self.moves[key] = self.moves.get(key, 0) + len(moved)
            if name in TOP_MEDIA and src.name not in TOP_MEDIA:  # loaded back up
                self.read_back.setdefault(src.name, set()).update(h for h in moved if h in res)

    def _lora_store(
        self, medium: str, resident: dict[BlockHash, float], hashes: list[BlockHash], lora: str
    ) -> None:
        name = self._lora_names.get(lora)
        if name is None:
            if len(self._lora_names) < self.options.max_lora_names:
                name = self._lora_names[lora] = lora
            else:
                self.lora_refused += 1
                name = LORA_OTHER
        new = [h for h in hashes if h not in resident]
        if not new:
            return
        self.lora_of.setdefault(medium, {}).update(zip(new, repeat(name)))
        counts = self.lora_blocks.setdefault(medium, {})
        counts[name] = counts.get(name, 0) + len(new)

    def _lora_remove(self, medium: str, lo: dict[BlockHash, str], gone: list[BlockHash]) -> None:
        counts = self.lora_blocks[medium]
        for name in map(lo.pop, gone, repeat(None)):
            if name is not None:
                counts[name] -= 1

    # --- read-outs ----------------------------------------------------------------------------

    def restored(self) -> dict[str, int]:
        """Blocks restored within the window, per medium."""
        return {m: r.restored for m, r in self.recent.items()}

    @property
    def restore_refused(self) -> int:
        """Removals the restore window could not track (its cap), all media."""
        return sum(r.refused for r in self.recent.values())


DEFAULT_ANALYTICS = AnalyticsOptions()
