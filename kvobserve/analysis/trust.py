"""How far to trust one stream's block index: a state with its reason (docs/cache-analytics.md).

The state follows what the sequence numbers show; it never looks at the blocks themselves.
Evidence of loss that the sequence cannot show (a publisher that drops batches before numbering
them) is counted separately by `analysis/analytics.py` while the state is not `partial`.

- `complete`: every batch since the publisher's start (seq 0, or a replay from 0 that returned
  everything) or since an `AllBlocksCleared` was applied in order.
- `replay_filled`: as complete, but at least one gap was filled by replay since then.
- `partial`: batches are missing (joined mid-stream, lost for good, a second publisher): the
  resident set may lack blocks and may keep blocks whose removal was lost; or the index was
  restored from a checkpoint and the publisher's replay ring has not shown yet that the
  checkpoint's last batch is its own (`resuming`: docs/reliability.md).

An unverified tail is a reason, not a state: while a `complete` or `replay_filled` stream is idle
and nothing confirmed that its last batch was its publisher's last (no replay endpoint to ask, or
the ask failed), the reason reads `tail_unverified` (`StreamSequencer.trust_reason`). Nothing is
known to be missing, so the state, `state_complete` and the silent-loss evidence stay as they are;
the next batch in order, or a tail check that comes back empty, gives the state's own reason back.
"""

from __future__ import annotations

from typing import Final

COMPLETE: Final = "complete"
REPLAY_FILLED: Final = "replay_filled"
PARTIAL: Final = "partial"
TRUST_STATES: Final = (COMPLETE, REPLAY_FILLED, PARTIAL)

# reasons, by the state they go with
FROM_START: Final = "from_start"  # complete: the first batch was seq 0
REPLAYED_FROM_START: Final = "replayed_from_start"  # complete: joined late, replay from 0 was whole
CLEARED: Final = "cleared"  # complete: an AllBlocksCleared made the earlier history irrelevant
GAP_REPLAYED: Final = "gap_replayed"  # replay_filled
WAITING: Final = "waiting"  # partial: no batch yet
JOINED_MIDSTREAM: Final = "joined_midstream"  # partial: history before the first batch unknown
LOST_BATCHES: Final = "lost_batches"  # partial: a gap that no replay filled
SECOND_PUBLISHER: Final = "second_publisher"  # partial: two publishers' batches met in one index
RESUMING: Final = "resuming"  # partial: restored from a checkpoint, the ring has not confirmed it
TAIL_UNVERIFIED: Final = "tail_unverified"  # complete / replay_filled, idle: tail unchecked


class Trust:
    """The trust state of one stream and why."""

    __slots__ = ("reason", "state")

    def __init__(self) -> None:
        self.state: str = PARTIAL
        self.reason: str = WAITING

    def set(self, state: str, reason: str) -> None:
        """Enter `state` for `reason`."""
        self.state, self.reason = state, reason

    def lose(self, reason: str) -> None:
        """Batches are missing: partial."""
        self.set(PARTIAL, reason)

    def gap_filled(self) -> None:
        """A gap was filled entirely by replay: a complete view stays whole but says so."""
        if self.state != PARTIAL:
            self.set(REPLAY_FILLED, GAP_REPLAYED)

    @property
    def trusted(self) -> bool:
        """True unless partial: what `state_complete` (the older boolean) reports."""
        return self.state != PARTIAL
