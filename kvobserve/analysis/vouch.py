"""Whether a rank's block index can vouch for the numbers it serves: a state with its reason.

A rank whose index is incomplete (trust `partial`: waiting, joined mid-stream without a full
replay, lost batches, a second publisher) is *unvouched*: it serves no cache usage, blocks or
tokens as plain values, only `lower_tokens` / `lower_blocks`, a lower bound under its own name.
It vouches for itself again when the sequence makes it complete (an `AllBlocksCleared`, a
restart from seq 0, a replay from seq 0), or when it can show it from outside the sequence:

1. **Nothing in the index that the engine lacks.** A join's index (`waiting`, `joined_midstream`)
   holds only blocks stored after the join and has seen every removal since, so every block
   in it is resident in the engine: index ⊆ engine. After a loss (`lost_batches`,
   `second_publisher`) the index may hold blocks whose removal was lost; that can end only when
   every block resident in the index at the loss has left it since (checked once per update:
   the blocks still there are `unsettled`). A block removed in the lost batches is never
   removed again, so this waits for good while one remains: it is the rule "every block
   resident at the join has since been removed", the only way a loss's extra blocks go.
2. **No room in the engine for a block the index lacks.** The engines report two counts of
   their KV cache (kvobserve/engines/: SGLang `sglang:token_usage` * `max_total_num_tokens`,
   `num_tokens` of its load channel, KvMetrics `kv_active_blocks`; vLLM
   `vllm:kv_cache_usage_perc` * `num_gpu_blocks` * `block_size`): the *used* tokens are what
   running requests hold (SGLang: total - available - evictable; vLLM: blocks with
   ref_cnt > 0), the *capacity* is the pool. The prefix cache, which the events describe, holds
   the used blocks that are full and stored **plus** free blocks still cached (evictable), and
   used counts tokens no event names (vLLM's partly filled blocks, SGLang's tokens not yet in
   the radix tree). So used ≤ resident does not hold exactly, and resident ≤ capacity always
   does: used tokens can never show that nothing is missing (equal counts are a coincidence,
   `tests/unit/test_vouch.py` shows both ways on the simulator), capacity can. With
   index ⊆ engine, when the index's top tier holds `capacity - (min_block_tokens - 1)` tokens
   or more (and no more than capacity), no block of the engine can be missing from it: the
   index is exact and vouches ("holds_capacity"). `min_block_tokens` is the fewest tokens a
   block the index lacks can hold: 1 in general (SGLang's last page of a sequence), the block
   size for engines that store only full blocks (vLLM). A busy engine's cache is full, so this
   holds once every block from before the join has been evicted; a cache that is not full, or
   one whose oldest blocks are hot (a system prompt every request reuses, never evicted), stays
   unvouched, and says so: the warning condition after the configured time.

Vouching covers the whole index, so it needs the lower tiers empty (their capacity is not known
here). The capacity must be sampled after the loss (`on_capacity`'s time): a sample of an engine
before its restart may be of another configuration. Pure: `now` is any monotonic clock, the
same for the capacity's `at`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kvobserve.analysis import trust as t
from kvobserve.analysis.blocks import BlockIndex
from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.analysis.tiers import TOP_MEDIA, Tier
from kvobserve.wire.kv_events import BlockHash

HOLDS_CAPACITY: Final = "holds_capacity"  # vouched: the index fills the engine's capacity
# reasons after which the index holds only blocks stored since (a join): nothing extra
JOIN_REASONS: Final = frozenset({t.WAITING, t.JOINED_MIDSTREAM})


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the index vouches for now."""

    vouched: bool
    reason: str  # vouched: the trust reason or HOLDS_CAPACITY; else the trust reason
    since: float  # when `vouched` last changed (the injected clock)
    lower_tokens: int  # top-tier tokens certainly resident (the value itself when vouched)
    lower_blocks: int  # ... and blocks
    unsettled: int = 0  # blocks in the index since before the last loss, not left since


def losses(sq: StreamSequencer) -> int:
    """A count that grows with every event after which the index may lack blocks or hold extra
    ones: lost batches, publisher restarts, batches of a second publisher."""
    return sq.lost + sq.restarts + sq.interleaved_batches


def top_tier(index: BlockIndex) -> Tier | None:
    """The tier where the engine computes (GPU, or DEVICE), if the index has one."""
    for name, tier in index.tiers.items():
        if name in TOP_MEDIA:
            return tier
    return None


class Vouch:
    """The vouch state of one rank's index."""

    __slots__ = (
        "_capacity",
        "_epoch",
        "_losses",
        "_pending",
        "_reason",
        "_trusted",
        "min_block_tokens",
        "since",
        "vouched",
    )

    def __init__(self, min_block_tokens: int = 1, now: float = 0.0) -> None:
        if min_block_tokens < 1:
            raise ValueError(f"min_block_tokens={min_block_tokens}: must be >= 1")
        self.min_block_tokens = min_block_tokens
        self.vouched = False
        self.since = now
        self._trusted: bool | None = None  # the trust seen last (None: none yet)
        self._reason = ""
        self._losses = 0
        self._epoch = now  # when the last loss or join was seen
        self._pending: set[BlockHash] = set()  # index blocks from before the loss still in it
        self._capacity: tuple[float, float] | None = None  # (tokens, sampled at)

    def on_capacity(self, tokens: float | None, at: float) -> None:
        """The engine's KV capacity in tokens as sampled at `at` (None or 0: unknown)."""
        self._capacity = (tokens, at) if tokens else None

    def update_from(self, now: float, sq: StreamSequencer) -> Verdict:
        """`update` with the sequencer's trust, losses and index."""
        return self.update(now, sq.trust.state, sq.trust.reason, losses(sq), sq.index)

    def update(
        self, now: float, state: str, reason: str, loss_count: int, index: BlockIndex
    ) -> Verdict:
        """The verdict now, given the stream's trust state and reason, its `losses` count and
        its index (read, not changed: call it on the thread that applies the index)."""
        top = top_tier(index)
        tokens = top.tokens if top is not None else 0
        blocks = len(top.resident) if top is not None else 0
        trusted = state != t.PARTIAL
        if trusted:
            self._pending = set()
            self._set(True, now)
        elif self._trusted is not False or reason != self._reason or loss_count != self._losses:
            self._lost(now, reason, top)  # a new loss or join: whatever showed before is void
        elif self._pending and top is not None:
            self._pending = set(filter(top.resident.__contains__, self._pending))
        self._trusted, self._reason, self._losses = trusted, reason, loss_count
        if not self.vouched and self._shows_whole(index, top, tokens):
            self._set(True, now)
        why = reason if trusted or not self.vouched else HOLDS_CAPACITY
        if self.vouched:
            return Verdict(True, why, self.since, tokens, blocks)
        held = self._pending_tokens(index, top) if self._pending else 0
        return Verdict(
            False, why, self.since, tokens - held, blocks - len(self._pending), len(self._pending)
        )

    def _set(self, vouched: bool, now: float) -> None:
        if vouched != self.vouched:
            self.vouched, self.since = vouched, now

    def _lost(self, now: float, reason: str, top: Tier | None) -> None:
        self._set(False, now)
        self._epoch = now
        # after a join every block in the index was stored since; after a loss any may be extra
        keep = reason not in JOIN_REASONS and top is not None
        self._pending = set(top.resident) if keep and top is not None else set()

    def _shows_whole(self, index: BlockIndex, top: Tier | None, tokens: int) -> bool:
        """Index ⊆ engine and no room left in the engine for a block the index lacks."""
        cap = self._capacity
        if top is None or self._pending or cap is None or cap[1] < self._epoch:
            return False
        if any(tier.resident for tier in index.tiers.values() if tier is not top):
            return False  # a lower tier's capacity is not known here
        return cap[0] - (self.min_block_tokens - 1) <= tokens <= cap[0]

    def _pending_tokens(self, index: BlockIndex, top: Tier | None) -> int:
        """Tokens of the unsettled blocks (the usual size but where the tier says otherwise)."""
        if top is None:
            return 0
        n, odd = len(self._pending), top.odd
        if not odd:
            return n * index.block_size
        odd_here = self._pending & odd.keys()
        return (n - len(odd_here)) * index.block_size + sum(odd[h] for h in odd_here)
