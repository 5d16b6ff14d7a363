"""Per-stream sequence tracking: gaps and replay, restarts, duplicates, interleaved publishers.

One `StreamSequencer` per (worker, dp_rank) stream owns the stream's `BlockIndex` and applies
batches to it itself, in seq order and exactly once. It returns only I/O actions: `RequestReplay`
(replaces any replay in flight) and `CancelReplay`. Inputs: live batches (`on_batch`), replayed
ones (`on_replay_batch`), the end marker or a failure (`on_replay_end`), `expire(now)` at every
wake-up of the ingest loop and `check_tail(now, ...)` once a second (an idle stream's tail check,
`analysis/tail.py`); `now` is a monotonic receive clock, engine time is only `batch.ts`. The
rules are in docs/stream-semantics.md.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Final, Protocol

from kvobserve.analysis import trust as t
from kvobserve.analysis.actions import Action, CancelReplay, RequestReplay
from kvobserve.analysis.blocks import BlockIndex
from kvobserve.analysis.tail import TailWatch
from kvobserve.wire.kv_events import KvBatch

# how a replay ended, counted in `replay_requests`
REPLAY_RESULTS: Final = ("ok", "partial", "timeout", "error", "overflow", "aborted")
_RECENT = 8  # payloads kept (by reference) to recognise duplicate deliveries
_OTHER_WINDOW = 64  # how far a known second head may jump and still be recognised as itself
_OTHER_RUN_LIMIT = 16  # "other" batches in a row with this head silent: the other one is live
_NOTHING_YET = -1  # the tail schedule's last seq while a stream has received no batch
_NEVER_MISSED = 1 << 62  # an idle join's `missed_from` until live delivers its first batch


class BatchTap(Protocol):
    """What a stream's sequencer tells of the batches it applies (`miss_sample.RankTap`)."""

    def observe(self, batch: KvBatch) -> None:
        """A batch applied to the index."""

    def cleared(self, ts: float) -> None:
        """The index was reset (a new publisher); `ts`: the last batch's engine time."""


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
    # replayed seqs live had not reached, with their payloads
    ahead: dict[int, tuple[KvBatch, bytes]] = field(default_factory=dict)
    tail: bool = False  # an idle stream's tail check: nothing was known to be missing
    anchor: bytes | None = None  # tail check after a reconnect: our last batch's bytes, to match
    found: int = 0  # tail check: batches live had not delivered, applied from the reply
    found_from: int = 0  # ... the first seq of the gap they filled
    idle: bool = False  # a join of a publisher that sent nothing since we connected
    recovered: int = 0  # batches of a hole live saw (held meanwhile) that the reply filled
    resume: bool = False  # restored from a checkpoint: the anchor decides whether we go on


class StreamSequencer:
    """Sequence state of one (worker, dp_rank) KV-event stream; applies batches to `index`."""

    def __init__(
        self,
        dp_rank: int | None,
        *,
        replay: bool,
        index: BlockIndex | None = None,
        limits: SequencerLimits = DEFAULT_LIMITS,
    ) -> None:
        self.dp_rank = dp_rank
        self.replay_enabled = replay
        self.index = index if index is not None else BlockIndex()
        self.limits = limits
        self.batches_applied = self.gaps = self.missed = self.recovered = self.lost = 0
        self.replay_requests: dict[str, int] = dict.fromkeys(REPLAY_RESULTS, 0)
        self.restarts = self.duplicate_batches = self.rank_mismatch_batches = 0
        self.interleaved_batches = 0  # dropped: they belong to a second publisher
        self.trust = t.Trust()  # complete / replay_filled / partial, with the reason
        self.last_seq: int | None = None
        self.last_ts: float | None = None
        self.last_payload = (
            b""  # the payload bytes of the last batch applied (a checkpoint's anchor)
        )
        self.duplicate_stream_seen: float | None = None  # the latest evidence of a second publisher
        self.duplicate_stream_began: float | None = None  # the first evidence of this episode
        # rare happenings for the event log (sources/stream_events.py): (kind, seq, seq, now)
        self.notes: deque[tuple[str, int, int, float]] = deque(maxlen=32)
        self._recent: deque[tuple[int, bytes]] = deque(maxlen=_RECENT)
        self._replay: ReplayInFlight | None = None
        self._replay_ids = 0
        self._high = -1  # highest live seq accepted (== last_seq when no replay is in flight)
        self._pending: list[tuple[KvBatch, bytes]] = []  # candidate head after a fallback
        self._pending_since = 0.0
        self._other: int | None = None  # last seq of a second (or retired) head
        self._other_seen, self._other_run = 0.0, 0
        self._other_confirmed = False  # seen alternating; a retired head must go on exactly +1
        self.tail = TailWatch(limits.tail_first_s, limits.tail_max_wait_s)
        # the miss split's sampler of the rank's pool (analysis/miss_sample.py): told of every
        # applied batch and every reset, in order; None: no split
        self.tap: BatchTap | None = None
        # payloads a tail check applied before live delivered them, to know a late live copy
        self._tail_copies: dict[int, bytes] = {}
        self._tail_found_at = 0.0
        # restored from a checkpoint: the trust it had, given back once the ring shows that
        # the checkpoint's last batch is our publisher's (`resume`); None: nothing pending
        self._restored: tuple[str, str] | None = None

    def on_batch(self, batch: KvBatch, payload: bytes, now: float) -> Action | None:
        """A live batch and its payload bytes (kept by reference for duplicate checks)."""
        if self.dp_rank is not None and batch.dp_rank is not None and batch.dp_rank != self.dp_rank:
            self.rank_mismatch_batches += 1
        last = self.last_seq
        if (
            last is not None
            and batch.seq == last + 1
            and self._replay is None
            and self._other is None
            and not self._pending
        ):
            # In order with nothing in flight (nearly every batch): expire() has nothing to
            # do and _on_live() would accept it; take that path without the calls.
            self._accept(batch, payload)
            return None
        action = self.expire(now)
        if self._pending:
            return self._on_pending(batch, payload, now) or action
        return self._route(batch, payload, now) or action

    def _route(self, batch: KvBatch, payload: bytes, now: float) -> Action | None:
        step = self._on_held if self._replay is not None else self._on_live
        return step(batch, payload, now)

    def on_replay_batch(
        self, replay_id: int, batch: KvBatch, payload: bytes = b"", now: float | None = None
    ) -> Action | None:
        """A batch of replay `replay_id` and its payload bytes; stale replies and seqs outside the
        hole are ignored. An action only when a tail check finds another publisher (a restart)."""
        rp = self._replay
        if rp is None or rp.replay_id != replay_id:
            return None
        seq = batch.seq
        if rp.anchor is not None:
            return self._check_anchor(rp, batch, payload, rp.started if now is None else now)
        rp.covered = max(rp.covered, seq)
        last = self.last_seq if self.last_seq is not None else -1
        if seq <= last:
            return None  # already applied
        if seq > self._high:  # live has not got here yet
            if rp.idle:
                self._idle_join_batch(rp, batch, payload, rp.started if now is None else now)
            elif rp.tail:
                self._tail_found(rp, batch, payload, rp.started if now is None else now)
            elif len(rp.ahead) < self.limits.hold_limit:  # kept in case live loses it
                rp.ahead[seq] = (batch, payload)
            return None
        self._advance_to(rp, seq)
        if rp.held and rp.held[0][0].seq == seq:
            rp.held.popleft()  # live had it too: not a recovery
            self._apply(batch, payload)
        else:
            self._recover(rp, batch, payload)
        return None

    def on_replay_end(
        self, replay_id: int, result: str = "ok", now: float | None = None
    ) -> RequestReplay | None:
        """The end marker (`ok`) or a failure of replay `replay_id`; may ask for younger holes."""
        rp = self._replay
        if rp is None or rp.replay_id != replay_id:
            return None
        if rp.anchor is not None and self._restored is not None and result == "ok":
            # resuming, and the ring holds nothing from the checkpoint's seq on: the
            # publisher's seq went back, it is another process (a restart: reset)
            action = self._publisher_replaced(rp, rp.started if now is None else now)
            return action if isinstance(action, RequestReplay) else None
        prev = self.last_seq if self.last_seq is not None else -1
        for batch, _ in rp.held if result == "ok" else ():
            if batch.seq - 1 > rp.covered and batch.seq > prev + 1:
                break  # a hole published after the engine answered: ask again from there
            prev = batch.seq
        else:
            self._finish_replay(result)
            return None
        hole = max(prev + 1, rp.covered + 1)
        self._finish_replay(result, upto=hole)
        self._replay_ids += 1
        ahead = {q: b for q, b in rp.ahead.items() if q > self._high}
        started = rp.started if now is None else now  # every held batch is older than this ask
        self._replay = ReplayInFlight(
            self._replay_ids, hole, started, False, rp.held, False, self._high, ahead
        )
        return RequestReplay(self._replay_ids, hole)

    def expire(self, now: float) -> Action | None:
        """Time-driven transitions: replay timeout, restart confirmation, quiet second heads."""
        if self._other is not None and now - self._other_seen >= self.limits.other_memory_s:
            self._other = None
        action: Action | None = None
        rp = self._replay
        if rp is not None and now - rp.started >= self.limits.replay_timeout_s:
            action = CancelReplay(rp.replay_id)
            self._finish_replay("timeout")
        if self._pending and now - self._pending_since >= self.limits.restart_confirm_s:
            action = self._confirm_restart(now) or action
        return action

    def check_tail(
        self, now: float, last_at: float, reconnected: bool = False
    ) -> RequestReplay | None:
        """Ask the replay ring for batches after the last seq of a stream gone idle (`last_at`:
        when its last batch arrived), on the schedule of `analysis/tail.py`. After a reconnect
        the publisher may be another process: the check then asks from the last seq itself and
        goes on only if the ring holds that very batch (`_check_anchor`)."""
        if self._tail_copies and now - self._tail_found_at >= self.limits.replay_timeout_s:
            self._tail_copies.clear()  # a live copy of those would have come long ago
        if (
            not self.replay_enabled
            or self._replay is not None
            or self._pending
            or self.duplicate_stream(now)  # the ring answers for one of two publishers
        ):
            return None
        last = self.last_seq
        if last is None or not self.tail.due(now, last, last_at):
            return None
        anchor = None
        if reconnected:
            anchor = next((p for q, p in self._recent if q == last), None)
            if anchor is None:
                self.tail.settle(False)  # nothing to recognise our publisher by
                return None
        self._replay_ids += 1
        self._replay = ReplayInFlight(
            self._replay_ids, last + 1, now, False, covered=last, tail=True, anchor=anchor
        )
        start = last if anchor is not None else last + 1
        return RequestReplay(self._replay_ids, start, tail=True)

    def resume(
        self, last_seq: int, anchor: bytes, trust: tuple[str, str], now: float
    ) -> RequestReplay | None:
        """A stream restored from its checkpoint (its index filled already): `last_seq` the
        last batch applied and `anchor` its payload bytes, `trust` the state it had. Until the
        ring shows that batch byte for byte, the index is partial (`resuming`); then the trust
        comes back and what the stream missed while kvobserve was down is applied from the
        reply and counted as recovered. A reply that begins elsewhere is another publisher (a
        restart: reset); a ring that no longer reaches `last_seq` loses what lies between
        (counted); an empty one means the publisher's seq went back (a restart). Asked as a
        tail check (it waits behind gap replays); None without a replay endpoint (the caller
        should not restore: nothing could confirm it)."""
        self.last_seq = self._high = last_seq
        self._recent.append((last_seq, anchor))
        self._restored = trust
        self.trust.lose(t.RESUMING)
        if not self.replay_enabled:
            return None
        self._replay_ids += 1
        self._replay = ReplayInFlight(
            self._replay_ids, last_seq + 1, now, False, covered=last_seq, tail=True,
            anchor=anchor, resume=True,
        )  # fmt: skip
        return RequestReplay(self._replay_ids, last_seq, tail=True)

    @property
    def resuming(self) -> bool:
        """Restored from a checkpoint and not confirmed by the ring yet."""
        return self._restored is not None

    def check_join(self, now: float, connected_at: float) -> RequestReplay | None:
        """Ask the replay ring from seq 0 for a stream connected since `connected_at` that has
        received nothing yet, on the tail checks' schedule: a publisher that is already idle
        never sends the batch a join waits for. The reply is applied as a join: complete when
        the ring reaches seq 0 (or holds nothing: the publisher has published nothing), else
        joined mid-stream; live batches arriving meanwhile are held, as in any replay."""
        if (
            not self.replay_enabled
            or self.last_seq is not None
            or self._replay is not None
            or self._pending
            or self.duplicate_stream(now)
            or not self.tail.due(now, _NOTHING_YET, connected_at)
        ):
            return None
        self._replay_ids += 1
        self._replay = ReplayInFlight(
            self._replay_ids, _NEVER_MISSED, now, True, covered=-1, idle=True
        )
        return RequestReplay(self._replay_ids, 0, tail=True)

    def trust_reason(self, now: float, last_at: float | None, connected: bool) -> str:
        """The trust reason to report: `tail_unverified` while the stream is idle and nothing
        confirmed that its last batch was its publisher's last (docs/cache-analytics.md)."""
        askable = self.replay_enabled and connected
        if (
            self.trust.trusted
            and last_at is not None
            and self.tail.unverified(now, self.last_seq, last_at, askable)
        ):
            return t.TAIL_UNVERIFIED
        return self.trust.reason

    def mark_duplicate_stream(self, now: float) -> None:
        """Evidence of a second publisher on this stream (interleaving or a mirror)."""
        if not self.duplicate_stream(now):  # a new episode, not more evidence of this one
            self.duplicate_stream_began = now
        self.duplicate_stream_seen = now

    def duplicate_stream(self, now: float) -> bool:
        """True while duplicate-stream evidence is younger than `quiet_s`."""
        seen = self.duplicate_stream_seen
        return seen is not None and now - seen < self.limits.quiet_s

    @property
    def state_complete(self) -> bool:
        """Not partial (the boolean of older snapshots, derived from `trust`)."""
        return self.trust.trusted

    @property
    def replay_in_flight(self) -> int | None:
        """The id of the replay in flight, if any."""
        return self._replay.replay_id if self._replay is not None else None

    def _on_live(self, batch: KvBatch, payload: bytes, now: float) -> Action | None:
        seq = batch.seq
        last = self.last_seq
        if last is None:
            return self._join(batch, payload, now)
        if seq == last + 1:
            self._accept(batch, payload)
            return None
        if seq <= last and self._is_duplicate(seq, payload):
            return None
        if self._is_other_head(batch, payload, last, now):
            return None
        if seq > last + 1:
            return self._gap(batch, payload, last, now)
        self._pending.append((batch, payload))  # fell back: restart or a second publisher
        self._pending_since = now
        return None

    def _join(self, batch: KvBatch, payload: bytes, now: float) -> Action | None:
        """First batch of a publisher (start or confirmed restart)."""
        seq = batch.seq
        if seq == 0:
            self.trust.set(t.COMPLETE, t.FROM_START)
        else:
            self.trust.lose(t.JOINED_MIDSTREAM)  # a replay from 0 may still make it whole
            self.notes.append(("join", seq, 0, now))
        if seq == 0 or not self.replay_enabled:
            self._accept(batch, payload)
            return None
        self._high = seq
        return self._start_replay(0, seq, now, batch, payload, join=True)

    def _gap(self, batch: KvBatch, payload: bytes, last: int, now: float) -> Action | None:
        n = batch.seq - last - 1
        self.gaps += 1
        self.missed += n
        self.notes.append(("gap", last + 1, batch.seq - 1, now))
        if not self.replay_enabled:
            self.lost += n
            self.trust.lose(t.LOST_BATCHES)
            self._accept(batch, payload)
            return None
        self._high = batch.seq
        return self._start_replay(last + 1, last + 1, now, batch, payload, join=False)

    def _start_replay(
        self, start: int, missed_from: int, now: float, batch: KvBatch, payload: bytes, join: bool
    ) -> RequestReplay:
        self._replay_ids += 1
        rp = self._replay = ReplayInFlight(
            self._replay_ids, missed_from, now, join, covered=batch.seq
        )
        rp.held.append((batch, payload))
        self._recent.append((batch.seq, payload))
        return RequestReplay(rp.replay_id, start)

    def _on_held(self, batch: KvBatch, payload: bytes, now: float) -> Action | None:
        """A live batch while a replay is in flight: hold it in seq order."""
        rp = self._replay
        assert rp is not None
        seq = batch.seq
        high = self._high
        if seq <= high and self._is_duplicate(seq, payload):
            return None
        if self._is_other_head(batch, payload, high, now):
            return None if self._replay is rp else CancelReplay(rp.replay_id)  # swapped heads
        if seq <= high:
            self._pending.append((batch, payload))  # fell back: restart or a second publisher
            self._pending_since = now
            return None
        if len(rp.held) >= self.limits.hold_limit:
            # the replay cannot catch up within the hold budget: give up, go on without it
            self._finish_replay("overflow")
            return self._on_live(batch, payload, now) or CancelReplay(rp.replay_id)
        if rp.idle and high < 0:  # the first live batch of an idle join: where live joins
            rp.missed_from = seq
        elif seq > high + 1:
            self.gaps += 1
            self.missed += seq - high - 1
            self.notes.append(("gap", high + 1, seq - 1, now))
        rp.held.append((batch, payload))
        self._recent.append((seq, payload))
        self._high = seq
        return None

    def _on_pending(self, batch: KvBatch, payload: bytes, now: float) -> Action | None:
        """Decide between a restart and a second publisher after a fallback."""
        seq = batch.seq
        cand = self._pending[-1][0].seq
        head = self._high
        if seq == cand and payload == self._pending[-1][1]:
            self.duplicate_batches += 1
            return None
        d_old, d_cand = seq - head, seq - cand
        if d_old > 0 and (d_cand <= 0 or d_old <= d_cand):
            # the old head goes on: a second publisher, not a restart
            self.interleaved_batches += len(self._pending)
            self._pending.clear()
            self._other, self._other_seen = cand, now
            self._other_confirmed, self._other_run = True, 0
            self.mark_duplicate_stream(now)
            self.trust.lose(t.SECOND_PUBLISHER)
            return self._route(batch, payload, now)
        if d_cand > 0:
            self._pending.append((batch, payload))
            if len(self._pending) >= self.limits.restart_confirm_batches:
                return self._confirm_restart(now)
            return None
        # a third fallback: the candidate was a real restart (crash loop); decide this one anew
        action = self._confirm_restart(now)
        return self._route(batch, payload, now) or action

    def _confirm_restart(self, now: float) -> Action | None:
        """The candidate head is a restarted publisher: reset and replay its batches."""
        pending, self._pending = self._pending, []
        action: Action | None = None
        if self._replay is not None:
            action = CancelReplay(self._replay.replay_id)
            self._finish_replay("aborted")
        self.restarts += 1
        self.notes.append(("restart", self._high, pending[0][0].seq if pending else 0, now))
        self._other = self.last_seq  # the retired head; if it goes on, it was interleaving
        self._other_seen, self._other_confirmed, self._other_run = now, False, 0
        self._reset()
        for batch, payload in pending:
            action = self._route(batch, payload, now) or action
        return action

    def _reset(self) -> None:
        """A new publisher: its cache starts empty and its first batch decides the trust."""
        self.trust.lose(t.WAITING)
        self.index.reset()
        if self.tap is not None:
            self.tap.cleared(self.last_ts or 0.0)
        self._recent.clear()
        self._tail_copies.clear()
        self.last_seq, self._high = None, -1

    def _is_duplicate(self, seq: int, payload: bytes) -> bool:
        for s, p in self._recent:
            if s == seq and (p is payload or p == payload):
                self.duplicate_batches += 1
                return True
        if self._tail_copies.get(seq) == payload:  # live delivered what a tail check applied
            self.duplicate_batches += 1
            return True
        return False

    def _check_anchor(
        self, rp: ReplayInFlight, batch: KvBatch, payload: bytes, now: float
    ) -> Action | None:
        """The first reply of a tail check after a reconnect (or of a resume) must be our last
        batch, byte for byte: then the ring is our publisher's and what follows continues our
        stream."""
        seq, last = batch.seq, self.last_seq
        if seq == last and payload == rp.anchor:
            rp.anchor, rp.covered = None, seq
            if self._restored is not None:  # the checkpoint is our publisher's: as it was
                self.trust.set(*self._restored)
                self._restored = None
            return None
        if seq == last:  # another batch under our last seq: the publisher restarted
            return self._publisher_replaced(rp, now)
        if self._restored is not None and last is not None and seq > last:
            # resuming, and the ring no longer reaches the checkpoint: what lies between is
            # lost, what the ring holds is applied (the index now lacks what was lost)
            self.trust.set(*self._restored)
            self._restored = None
            rp.anchor = None
            # one gap from last + 1: the seqs before this one lost, this one recovered
            self._tail_found(rp, batch, payload, now)
            return None
        self._finish_replay("aborted")  # the ring no longer holds our last seq: it cannot vouch
        return None

    def _publisher_replaced(self, rp: ReplayInFlight, now: float) -> Action | None:
        """The publisher restarted while the stream was away: reset as for a restart (nothing of
        the reply is applied); live batches held meanwhile are the new publisher's."""
        self._replay = None
        self._restored = None
        self.restarts += 1
        self.notes.append(("replaced", rp.missed_from - 1, 0, now))
        self._other = None  # the old publisher is gone, not a second head
        self._reset()
        action: Action | None = None
        for batch, payload in rp.held:
            action = self._route(batch, payload, now) or action
        return action

    def _tail_found(self, rp: ReplayInFlight, batch: KvBatch, payload: bytes, now: float) -> None:
        """A tail check's reply carries a batch live never delivered: lost at the end of a burst."""
        seq = batch.seq
        if not rp.found:
            self.gaps += 1
            rp.found_from = self._high + 1
        self.missed += seq - self._high
        self._advance_to(rp, seq)  # held live batches first; seqs the ring skipped are lost
        rp.found += 1
        self.recovered += 1
        self._high = seq
        self._recent.append((seq, payload))
        if payload and len(self._tail_copies) < self.limits.hold_limit:
            self._tail_copies[seq] = payload
            self._tail_found_at = now
        self._apply(batch, payload)

    def _idle_join_batch(
        self, rp: ReplayInFlight, batch: KvBatch, payload: bytes, now: float
    ) -> None:
        """A batch of an idle join's reply that live has not delivered: applied in order. The
        ring's first batch says whether the index can be whole (seq 0) or joins mid-stream."""
        seq = batch.seq
        if self.last_seq is None and seq > 0:
            self.notes.append(("join", seq, 0, now))
        self._advance_to(rp, seq)  # seqs before the ring's first: never seen (joined mid-stream)
        self._high = seq
        self._recent.append((seq, payload))
        self._apply(batch, payload)

    def _is_other_head(self, batch: KvBatch, payload: bytes, head: int, now: float) -> bool:
        """Whether `batch` continues the remembered second head (then it is consumed here)."""
        seq = batch.seq
        other = self._other
        if other is None:
            return False
        d_other, d_head = seq - other, seq - head
        window = _OTHER_WINDOW if self._other_confirmed else 1
        if not (0 < d_other <= window and (d_head <= 0 or d_other < d_head)):
            return False
        self._other_run += 1
        if self._other_run > _OTHER_RUN_LIMIT:
            self._swap_heads(seq, now)
            self._accept(batch, payload)
            return True
        self._other, self._other_seen, self._other_confirmed = seq, now, True
        self.interleaved_batches += 1
        # two publishers' events in one index: it is not trustworthy any more
        self.mark_duplicate_stream(now)
        self.trust.lose(t.SECOND_PUBLISHER)
        return True

    def _swap_heads(self, seq: int, now: float) -> None:
        """Only the "other" head advances, so it is the live one: swap; no gap, no restart."""
        if self._replay is not None:
            self._finish_replay("aborted")
        self._other, self._other_seen, self._other_run = self._high, now, 0
        self.trust.lose(t.SECOND_PUBLISHER)  # the batches dropped as "other" belonged here
        self.last_seq = self._high = seq - 1

    def _accept(self, batch: KvBatch, payload: bytes) -> None:
        self._recent.append((batch.seq, payload))
        self._high = batch.seq
        self._other_run = 0
        self._apply(batch, payload)

    def _apply(self, batch: KvBatch, payload: bytes) -> None:
        clears = self.index.clears_total
        self.index.apply_batch(batch)
        if self.tap is not None:
            self.tap.observe(batch)
        if self.index.clears_total != clears:
            self.trust.set(t.COMPLETE, t.CLEARED)  # what came before no longer matters
        self.batches_applied += 1
        self.last_seq = batch.seq
        self.last_ts = batch.ts
        self.last_payload = payload

    def _advance_to(self, rp: ReplayInFlight, seq: int) -> None:
        """Apply held batches below `seq`; count what is neither held nor replayed below it."""
        prev = self.last_seq if self.last_seq is not None else -1
        held = rp.held
        while held and held[0][0].seq < seq:
            batch, payload = held.popleft()
            self._fill(rp, prev + 1, batch.seq)
            self._apply(batch, payload)
            prev = batch.seq
        self._fill(rp, prev + 1, seq)

    def _fill(self, rp: ReplayInFlight, start: int, end: int) -> None:
        """Seqs [start, end) are not held: apply those the reply sent ahead, lose the rest."""
        if rp.ahead and end > start:
            for seq in sorted(q for q in rp.ahead if start <= q < end):
                self._skip(rp, start, seq)
                self._recover(rp, *rp.ahead.pop(seq))
                start = seq + 1
        self._skip(rp, start, end)

    def _recover(self, rp: ReplayInFlight, batch: KvBatch, payload: bytes) -> None:
        """Apply a replayed batch that live did not deliver."""
        if batch.seq >= rp.missed_from:
            self.recovered += 1
            rp.recovered += 1
        self._apply(batch, payload)

    def _skip(self, rp: ReplayInFlight, start: int, end: int) -> None:
        """Seqs [start, end) will never be applied."""
        if end <= start:
            return
        rp.lost = True
        self.trust.lose(t.JOINED_MIDSTREAM if end <= rp.missed_from else t.LOST_BATCHES)
        if end > rp.missed_from:
            self.lost += end - max(start, rp.missed_from)
        self.last_seq = end - 1

    def _finish_replay(self, result: str, upto: int | None = None) -> None:
        rp = self._replay
        assert rp is not None
        self._advance_to(rp, self._high + 1 if upto is None else upto)
        if rp.idle:
            self.tail.settle(result == "ok")
        if rp.tail and not rp.found and not rp.lost and not rp.recovered:
            # nothing was missing after the last seq (or nobody could say): nothing to count
            self.tail.settle(result == "ok" and rp.anchor is None)
            self._replay = None
            return
        if rp.found:
            self.notes.append(("gap", rp.found_from, rp.covered, rp.started))
        if result == "ok" and rp.lost:
            result = "partial"
        elif result == "ok" and rp.join:
            self.trust.set(t.COMPLETE, t.REPLAYED_FROM_START)  # the index saw everything
        elif result == "ok":
            self.trust.gap_filled()
        self.replay_requests[result] = self.replay_requests.get(result, 0) + 1
        self._replay = None
