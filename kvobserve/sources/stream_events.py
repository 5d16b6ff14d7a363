"""Recent events of a collector: gaps with their outcome, restarts, joins, duplicates, decode errors.

`RecentEvents` keeps the last MAX_EVENTS, numbered per process; every snapshot carries them and
the aggregator keeps each (collector, seq) once, so a lost snapshot loses no event. `StreamHistory`
turns one stream's sequencer notes and counters into events once per snapshot (in the ingest
thread; nothing on the per-batch path) and remembers when each kind last happened.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping

from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.wire.snapshot import MAX_EVENTS, Event

_MAX_PENDING = 16  # gap ranges kept per stream until their replay ends


class RecentEvents:
    """The collector's last `maxlen` events; `add` may be called from any thread."""

    def __init__(self, maxlen: int = MAX_EVENTS, wall: Callable[[], float] = time.time) -> None:
        self._events: deque[Event] = deque(maxlen=maxlen)
        self._lock = threading.Lock()
        self._wall = wall
        self._seq = 0

    def add(
        self,
        kind: str,
        message: str,
        *,
        worker_id: str = "",
        dp_rank: int | None = None,
        first_seq: int | None = None,
        last_seq: int | None = None,
        at: float | None = None,
    ) -> None:
        """Record one event (`at`: wall-clock time, default now)."""
        with self._lock:
            self._seq += 1
            ev = Event(self._seq, self._wall() if at is None else at, kind, worker_id, dp_rank,
                       message, first_seq, last_seq)  # fmt: skip
            self._events.append(ev)

    def recent(self) -> list[Event]:
        """The events kept, oldest first."""
        with self._lock:
            return list(self._events)


def _ranges(gaps: list[tuple[int, int, float]]) -> str:
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b, _ in gaps[:4]) + (
        ", ..." if len(gaps) > 4 else ""
    )


class StreamHistory:
    """Events and last-happened times of one stream, derived at each snapshot."""

    __slots__ = (
        "_dup",
        "_events",
        "_gaps",
        "_join",
        "_prev",
        "dp_rank",
        "incomplete_reason",
        "last",
        "worker_id",
    )

    def __init__(self, worker_id: str, dp_rank: int, events: RecentEvents) -> None:
        self.worker_id, self.dp_rank, self._events = worker_id, dp_rank, events
        self._gaps: list[tuple[int, int, float]] = []  # missed ranges awaiting their outcome
        self._join: tuple[int, float] | None = None
        self._dup = False
        self._prev: dict[str, int] = {}  # counter values at the last update
        self.last: dict[str, float] = {}  # gap, loss, restart, duplicate, decode_error, ... -> wall
        self.incomplete_reason = ""

    def _add(self, kind: str, message: str, at: float, **kw: int) -> None:
        self._events.add(kind, message, worker_id=self.worker_id, dp_rank=self.dp_rank, at=at, **kw)

    def _delta(self, name: str, value: int) -> int:
        before = self._prev.get(name, 0)
        self._prev[name] = value
        return value - before

    def update(
        self, sq: StreamSequencer, errors: Mapping[str, int], now: float, wall: float
    ) -> None:
        """Read the sequencer's notes and counters (`now` monotonic, `wall` the same instant)."""
        for kind, a, b, t in _drain(sq):
            at = wall - (now - t)
            if kind == "gap" and len(self._gaps) < _MAX_PENDING:
                self._gaps.append((a, b, at))
                self.last["gap"] = at
            elif kind == "join":
                self._join = (a, at)
            elif kind == "restart":
                self.last["restart"] = at
                msg = f"publisher restarted: seq fell back from {a} to {b}; block index reset"
                self._add("restart", msg, at)
            elif kind == "replaced":  # a tail check after a reconnect: another batch under seq a
                self.last["restart"] = at
                msg = f"publisher restarted while away: its seq {a} is another batch; index reset"
                self._add("restart", msg, at)
        if sq.replay_in_flight is None:
            self._settle(sq, wall)
        self._bursts(sq, errors, wall)
        dup = sq.duplicate_stream(now)
        if dup and sq.duplicate_stream_seen is not None:
            self.last["duplicate"] = wall - (now - sq.duplicate_stream_seen)
            self.incomplete_reason = "two publishers wrote into it (duplicate stream)"
        if dup != self._dup:
            self._dup = dup
            msg = "second publisher (interleaved or mirrored)" if dup else "second publisher gone"
            self._add("duplicate", msg, wall)
        if sq.state_complete:
            self.incomplete_reason = ""
        elif not self.incomplete_reason and sq.batches_applied:
            self.incomplete_reason = "joined mid-stream or lost batches"

    def _settle(self, sq: StreamSequencer, wall: float) -> None:
        """Outcomes of the gaps and the join once no replay is in flight."""
        recovered = self._delta("recovered", sq.recovered)
        lost = self._delta("lost", sq.lost)
        if self._gaps:
            gaps, self._gaps = self._gaps, []
            missed = sum(b - a + 1 for a, b, _ in gaps)
            if not lost:
                outcome = "recovered by replay" if recovered else "recovered"
            elif not sq.replay_enabled:
                outcome = f"{lost} lost (no replay endpoint)"
            else:
                outcome = f"{recovered} recovered, {lost} lost (not in the replay ring)"
            at = gaps[-1][2]
            self._add("gap", f"gap: seq {_ranges(gaps)} missed ({missed}); {outcome}", at,
                      first_seq=gaps[0][0], last_seq=gaps[-1][1])  # fmt: skip
            if lost:
                self.last["loss"] = at
                self.incomplete_reason = f"{lost} batches lost (seq {_ranges(gaps)})"
        elif lost:
            self.last["loss"] = wall
            self._add("gap", f"{lost} batches lost", wall)
            self.incomplete_reason = f"{lost} batches lost"
        if self._join is not None:
            seq, at = self._join
            self._join = None
            if sq.state_complete:
                self._add("join", f"joined at seq {seq}; replayed from seq 0: index complete", at)
                return
            why = "the replay did not reach seq 0" if sq.replay_enabled else "no replay endpoint"
            self.incomplete_reason = f"joined mid-stream at seq {seq} ({why})"
            self._add("join", f"joined mid-stream at seq {seq} ({why}): index incomplete", at)

    def _bursts(self, sq: StreamSequencer, errors: Mapping[str, int], wall: float) -> None:
        """Decode errors and rank mismatches: an event when a burst starts and when it ends."""
        for name, value, what in (
            ("decode_error", sum(errors.values()), "undecodable messages"),
            ("rank_mismatch", sq.rank_mismatch_batches, "batches naming another DP rank"),
        ):
            n = self._delta(name, value)
            burst = f"{name}_burst"
            if n > 0:
                self.last[name] = wall
                if not self._prev.get(burst):
                    reasons = ", ".join(sorted(errors)) if name == "decode_error" else ""
                    self._add(name, f"{what} started ({reasons or 'see counters'})", wall)
                self._prev[burst] = self._prev.get(burst, 0) + n
            elif self._prev.get(burst):
                self._add(name, f"{what} stopped after {self._prev[burst]}", wall)
                self._prev[burst] = 0


def _drain(sq: StreamSequencer) -> list[tuple[str, int, int, float]]:
    notes = list(sq.notes)
    sq.notes.clear()
    return notes
