"""What a StreamSequencer asks of its I/O (replay requests), the replay results it counts, its
limits, and the replay in flight."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Final

from kvobserve.wire.kv_events import KvBatch

REPLAY_RESULTS: Final = ("ok", "partial", "timeout", "error", "overflow", "aborted")


@dataclass(frozen=True, slots=True)
class SequencerLimits:
    """Tunables of a StreamSequencer (counts of batches, times in seconds of `now`)."""

    hold_limit: int = 4096  # live batches held while a replay runs; more: give the replay up
    replay_timeout_s: float = 5.0
    restart_confirm_batches: int = 3  # a fallen-back head going on this long is a restart
    restart_confirm_s: float = 2.0  # ... or staying unopposed this long
    quiet_s: float = 30.0  # the duplicate-stream gauge drops back after this much quiet
    other_memory_s: float = 600.0  # how long a second or retired head is remembered
    tail_first_s: float = 2.0  # an idle stream asks for its tail this long after its last batch
    tail_max_wait_s: float = 60.0  # ... then backs off, doubling the wait up to this

    def __post_init__(self) -> None:
        for name in ("hold_limit", "restart_confirm_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")


DEFAULT_LIMITS: Final = SequencerLimits()


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


@dataclass(slots=True)
class ReplayInFlight:
    """One replay in flight and the live batches held meanwhile."""

    replay_id: int
    missed_from: int  # seqs below were never counted missed (joined mid-stream)
    started: float
    join: bool
    held: deque[tuple[KvBatch, bytes]] = field(default_factory=deque)  # ascending seq
    lost: bool = False
    # The engine answers with its ring as of the request, so every seq <= `covered` that the
    # reply did not carry is not in the ring; a later hole may simply be younger than the reply.
    covered: int = -1
    ahead: dict[int, KvBatch] = field(default_factory=dict)  # replayed seqs live had not reached
    tail: bool = False  # an idle stream's tail check: nothing was known to be missing
    anchor: bytes | None = None  # tail check after a reconnect: our last batch's bytes, to match
    found: int = 0  # tail check: batches live had not delivered, applied from the reply
    found_from: int = 0  # ... the first seq of the gap they filled
