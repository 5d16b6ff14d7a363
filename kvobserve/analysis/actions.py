"""What a StreamSequencer asks of its I/O: a replay from a seq on, or to stop the one in flight.

The sequencer (analysis/sequence.py) returns these; the ingest loop's replay client
(sources/replays.py) carries them out.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestReplay:
    """Ask the stream's replay endpoint for every batch from `start_seq` on; `tail`: an idle
    stream's check for batches after its last one (waits behind gap replays)."""

    replay_id: int
    start_seq: int
    tail: bool = False


@dataclass(frozen=True, slots=True)
class CancelReplay:
    """Stop the replay in flight; its late replies are ignored anyway."""

    replay_id: int


Action = RequestReplay | CancelReplay
