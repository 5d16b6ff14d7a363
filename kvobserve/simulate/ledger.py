"""What one publisher instance's cache did beyond residency, for the truth file; and a CPU tier.

`CpuTier`: an LRU host tier (behind `SimConfig.cpu_tier_tokens`): pages evicted from the GPU are
offloaded to it (a store on the CPU medium, published before the GPU removal: the copy is made
before the device page is freed), a GPU store of a page it holds is an onboard (a load, not a
computation), and it evicts its least recently used pages when full.
`Ledger`: restores (a page stored again on a medium after its removal, with the gap in engine
seconds), stores of pages another rank of the node held, tier moves, pages removed from the CPU
tier without being read back, and the GPU pages of each LoRA adapter.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvobserve.simulate.cache import Hash

MAX_GAPS = 100_000  # restore gaps kept per medium: a long run's truth file stays bounded
MAX_REMOVED = 200_000  # removals remembered per medium to find restores


class CpuTier:
    """Pages on the host tier, LRU first, with their token counts."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self.pages: OrderedDict[Hash, int] = OrderedDict()
        self.used_tokens = 0
        self.read_back: set[Hash] = set()  # pages loaded back to the GPU at least once

    def offload(self, pages: list[tuple[Hash, int]]) -> tuple[list[tuple[Hash, int]], list[Hash]]:
        """Take the GPU's evicted pages: (pages stored here, pages evicted from here first)."""
        stored: list[tuple[Hash, int]] = []
        evicted: list[Hash] = []
        for h, n in pages:
            if h in self.pages:
                self.pages.move_to_end(h)
                continue
            while self.pages and self.used_tokens + n > self.capacity_tokens:
                old, k = self.pages.popitem(last=False)
                self.used_tokens -= k
                evicted.append(old)
            if n > self.capacity_tokens:
                continue
            self.pages[h] = n
            self.used_tokens += n
            stored.append((h, n))
        return stored, evicted

    def onboard(self, h: Hash) -> bool:
        """A GPU store of `h`: True (and touched) when this tier holds it."""
        if h not in self.pages:
            return False
        self.pages.move_to_end(h)
        self.read_back.add(h)
        return True

    def clear(self) -> None:
        """A flush empties the host tier too."""
        self.pages.clear()
        self.read_back.clear()
        self.used_tokens = 0


class Ledger:
    """Per publisher instance: the quantities kvobserve's cache analytics estimate."""

    def __init__(self) -> None:
        self.removed_at: dict[str, dict[Hash, float]] = {}
        self.restores: dict[str, int] = {}
        self.restore_gaps: dict[str, list[float]] = {}
        self.recomputed_elsewhere = 0
        self.moves: dict[str, int] = {}  # "GPU>CPU" -> pages
        self.unread_removed: dict[str, int] = {}
        self.lora_of: dict[Hash, str] = {}  # GPU pages stored by a request of an adapter

    def removed(self, medium: str, hashes: list[Hash], ts: float) -> None:
        """Pages left `medium` at `ts` (by eviction, not by a flush)."""
        d = self.removed_at.setdefault(medium, {})
        for h in hashes:
            d[h] = ts
        if medium == "GPU":
            for h in hashes:
                self.lora_of.pop(h, None)
        while len(d) > MAX_REMOVED:
            del d[next(iter(d))]

    def stored(self, medium: str, hashes: list[Hash], ts: float, lora: str | None = None) -> None:
        """Pages entered `medium` at `ts`."""
        d = self.removed_at.get(medium)
        for h in hashes:
            at = d.pop(h, None) if d else None
            if at is not None:
                self.restores[medium] = self.restores.get(medium, 0) + 1
                gaps = self.restore_gaps.setdefault(medium, [])
                if len(gaps) < MAX_GAPS:
                    gaps.append(ts - at)
            if lora and medium == "GPU":
                self.lora_of[h] = lora

    def moved(self, key: str, n: int) -> None:
        """`n` pages moved between tiers ("GPU>CPU" offloads, "CPU>GPU" onboards)."""
        self.moves[key] = self.moves.get(key, 0) + n

    def cleared(self) -> None:
        """A flush: nothing before it is restored, no adapter holds anything."""
        self.removed_at.clear()
        self.lora_of.clear()

    def lora_resident(self) -> dict[str, int]:
        """GPU pages per adapter now."""
        out: dict[str, int] = {}
        for name in self.lora_of.values():
            out[name] = out.get(name, 0) + 1
        return out

    def truth(self) -> dict[str, Any]:
        """The ledger as the truth file has it."""
        return {
            "restores": dict(self.restores),
            "restore_gaps": {m: list(g) for m, g in self.restore_gaps.items()},
            "recomputed_elsewhere": self.recomputed_elsewhere,
            "tier_moves": dict(self.moves),
            "unread_removed": dict(self.unread_removed),
            "lora_resident": self.lora_resident(),
        }
