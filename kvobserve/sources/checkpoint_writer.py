"""When and what a collector checkpoints: rounds of changed streams, copied on the ingest thread
within a budget, encoded and written by a thread of their own (docs/reliability.md, "Restarts of
kvobserve").

The ingest thread owns every stream's state, so only it may copy one (`analysis/checkpoint.py`
`copy_stream`: list copies, 20-80 ns a block as the hash objects lie in memory). It calls
`tick(now, streams)` at every turn of its loop: every `interval_s` a round begins with the
streams whose state changed since their last checkpoint was written (`checkpoint_mark`, compared
without a walk), and each tick copies the next of them until `budget_blocks` blocks are copied
(about 2 ms), so a round of 4 million blocks is spread over ticks instead of stopping ingest for
a third of a second; at most `max_in_flight` copies wait for the writer thread (more: the round
waits for it). The writer thread packs each copy, writes it (`CheckpointStore.write`: temp
file, fsync, rename) and fsyncs the directory once at the end of the round. A stream whose
write failed stays changed and is written in the next round.

The checkpoints' CPU is capped at `cpu_share` of one core on average (2 %): the ingest thread's
copies and the writer thread's packing and file I/O (a file's create, write, fsync and rename
cost 0.2-0.7 ms of system time on an ext4 VM disk, more than packing 1,000 blocks) are charged to
a budget that refills at `cpu_share` CPU-seconds per second, up to one interval's worth; while
it is spent, copying waits. A few streams are written every interval; thousands of busy ones
less often (`python -m benchmarks.checkpoint`: 4,096 busy streams of 1,000 blocks, each every
~4 minutes on that disk), which is what a resume needs as long as the engines' replay rings
reach back that far (docs/reliability.md).

At SIGTERM, `flush(streams, timeout_s)` copies every changed stream at once, budget or not (the
ingest thread has stopped, or this is it) and waits for the writer up to the time left; what is
not written by then is logged and resumes from its previous checkpoint. What SIGKILL leaves is
each stream's last round.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

import msgspec

from kvobserve import __version__
from kvobserve.analysis.checkpoint import StreamCopy, encode_copy
from kvobserve.sources.checkpoint_store import CheckpointStore
from kvobserve.wire.snapshot import CheckpointStats

log = logging.getLogger(__name__)

DEFAULT_BUDGET_BLOCKS = 25_000  # blocks copied per tick: ~2 ms of the ingest thread
DEFAULT_MAX_IN_FLIGHT = 64  # copies waiting for the writer thread
DEFAULT_CPU_SHARE = 0.02  # of one core, on average: the checkpoints' CPU budget


class Checkpointable(Protocol):
    """A stream as the writer sees it (the stream core provides these)."""

    @property
    def checkpoint_key(self) -> tuple[str, int]:
        """(worker_id, dp_rank): the file it is written to."""

    def checkpoint_mark(self) -> object:
        """A value that changes whenever the state to save does (`analysis.checkpoint.state_mark`)."""

    def checkpoint_copy(self) -> StreamCopy | None:
        """A consistent copy of its state (`analysis.checkpoint.copy_stream`); None: none to save."""


class _RoundEnd:
    """The marker after a round's last copy: the writer fsyncs the directory and says so."""

    __slots__ = ("done", "queued", "started")

    def __init__(self, started: float) -> None:
        self.started = started
        self.queued = False
        self.done = threading.Event()


_STOP = object()


class CheckpointWriter:
    """The checkpoint rounds of one collector's streams and the thread that writes them."""

    def __init__(
        self,
        store: CheckpointStore,
        interval_s: float,
        *,
        budget_blocks: int = DEFAULT_BUDGET_BLOCKS,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        cpu_share: float = DEFAULT_CPU_SHARE,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        cpu: Callable[[], float] = time.thread_time,
        version: str = __version__,
    ) -> None:
        if budget_blocks < 1 or max_in_flight < 1 or not 0 < cpu_share <= 1:
            raise ValueError("budget_blocks, max_in_flight >= 1 and 0 < cpu_share <= 1")
        self.store = store
        self.interval_s = interval_s
        self.budget_blocks = budget_blocks
        self.max_in_flight = max_in_flight
        self.cpu_share = cpu_share
        self._clock, self._wall, self._cpu, self._version = clock, wall, cpu, version
        # CPU seconds the checkpoints may still use: refilled at cpu_share per second of `now`,
        # up to one interval's worth; the writer thread's CPU is charged through `_spent`
        self._credit = cpu_share * interval_s
        self._credit_at: float | None = None
        self._spent = 0.0  # the writer's CPU not charged yet, less what was charged ahead
        self._per_block = 1e-6  # the writer's CPU per block copied, as measured (a moving mean)
        self.copy_cpu_s = 0.0  # CPU seconds of the ingest thread's copies
        self.write_cpu_s = 0.0  # ... and of the writer thread (packing, files, fsyncs)
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._in_flight = 0  # copies handed over and not yet written (both threads change it)
        self._count = threading.Condition()  # guards the two below; notified as copies are written
        self._done: dict[tuple[str, int], object] = {}  # key -> mark of its last written copy
        self._round: deque[Checkpointable] = deque()
        self._end: _RoundEnd | None = None  # the round being written
        self._next = 0.0  # when the next round may begin (ingest clock)
        self._thread: threading.Thread | None = None
        self.rounds = 0
        self.rounds_late = 0  # rounds begun later than due: the previous one was still written
        self.round_seconds = 0.0

    @property
    def enabled(self) -> bool:
        """Whether checkpoints are written at all (interval_s > 0)."""
        return self.interval_s > 0

    def start(self) -> None:
        """Start the writer thread (idempotent); opens the store."""
        if not self.enabled or self._thread is not None:
            return
        self.store.open()
        self._thread = threading.Thread(target=self._run, name="kvobserve-checkpoint", daemon=True)
        self._thread.start()

    # --- the ingest thread ----------------------------------------------------------------------

    def tick(self, now: float, streams: Iterable[Checkpointable]) -> None:
        """Begin a round when one is due, and copy the next streams of it within the budgets
        (blocks per tick, CPU on average)."""
        if self._thread is None:
            return
        self._refill(now)
        end = self._end
        if end is not None and end.queued:
            if not end.done.is_set():
                return  # the round's copies are still being written
            self._end = end = None
        if end is None:
            if now < self._next:
                return
            if self._next and now - self._next >= self.interval_s:
                self.rounds_late += 1
            self._next = now + self.interval_s
            self._round = deque(s for s in streams if self._changed(s))
            if not self._round:
                return  # nothing changed: no write, no fsync
            end = self._end = _RoundEnd(self._clock())
            self.rounds += 1
        self._copy(self.budget_blocks)
        if not self._round:
            end.queued = True
            self._put(end, count=False)

    def wait_round(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the round handed over to be written; False when it is not
        (or not all of it is copied yet: more ticks are needed). True when no round is open."""
        end = self._end
        if end is None:
            return True
        return end.queued and end.done.wait(timeout_s)

    def drain(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until no copy waits for the writer thread; False if one does."""
        with self._count:
            return self._count.wait_for(lambda: self._in_flight == 0, timeout_s)

    def _refill(self, now: float) -> None:
        with self._count:
            spent, self._spent = self._spent, 0.0
        if self._credit_at is not None:
            self._credit += (now - self._credit_at) * self.cpu_share
        self._credit = min(self._credit, self.cpu_share * self.interval_s) - spent
        self._credit_at = now

    def _changed(self, s: Checkpointable) -> bool:
        return s.checkpoint_mark() != self._done.get(s.checkpoint_key, _STOP)

    def _copy(self, budget: int | None) -> None:
        """Copy streams of the round until `budget` blocks are copied (None: all of them)."""
        copied = 0
        while self._round and (budget is None or copied < budget):
            if budget is not None and (self._in_flight >= self.max_in_flight or self._credit <= 0):
                return  # the writer is behind, or the CPU budget spent: a later tick goes on
            s = self._round.popleft()
            t0 = self._cpu()
            mark = s.checkpoint_mark()
            copy = s.checkpoint_copy()
            used = self._cpu() - t0
            self.copy_cpu_s += used
            self._credit -= used
            if copy is None:
                continue
            # its write is charged ahead, as the last writes cost: copies in flight do not
            # overdraw the budget (the writer settles the difference)
            ahead = (copy.blocks + 1) * self._per_block
            self._credit -= ahead
            self._put((copy, mark, ahead))
            copied += copy.blocks + 1

    def _put(self, item: object, count: bool = True) -> None:
        if count:
            with self._count:
                self._in_flight += 1
        self._queue.put(item)

    def flush(self, streams: Iterable[Checkpointable], timeout_s: float) -> int:
        """At shutdown: copy every changed stream now, wait up to `timeout_s` for them to be
        written; returns how many were not (logged)."""
        if self._thread is None:
            return 0
        end = self._end
        self._round = deque(s for s in streams if self._changed(s))
        if not self._round and (end is None or end.done.is_set()):
            return 0
        self._copy(None)
        end = self._end = _RoundEnd(self._clock())
        end.queued = True
        self._put(end, count=False)
        if end.done.wait(timeout_s):
            return 0
        left = self._in_flight
        log.warning("%d checkpoints not written within the %.1f s left before exit; "
                    "they resume from their previous checkpoint", left, timeout_s)  # fmt: skip
        return left

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the writer thread after what it holds (waits up to `timeout_s`); idempotent."""
        t, self._thread = self._thread, None
        if t is None:
            return
        self._queue.put(_STOP)
        t.join(timeout_s)
        self.store.close()

    # --- the writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        failed = False  # a write of this round failed
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if isinstance(item, _RoundEnd):
                t0 = self._cpu()
                self.store.sync(not failed)
                failed = False
                used = self._cpu() - t0
                with self._count:
                    self._spent += used
                    self.write_cpu_s += used
                self.round_seconds = self._clock() - item.started
                item.done.set()
                continue
            assert isinstance(item, tuple)
            copy: StreamCopy = item[0]
            mark: object = item[1]
            ahead: float = item[2]
            t0 = self._cpu()
            try:
                data = encode_copy(copy, self._version, self._wall())
                if self.store.write(copy.identity.key, data):
                    self._done[copy.identity.key] = mark
                else:
                    failed = True
            except Exception:  # a bug must not end the thread: the stream is retried
                failed = True
                log.exception("checkpoint of %s rank %d", *copy.identity.key)
            finally:
                used = self._cpu() - t0
                with self._count:
                    self._in_flight -= 1
                    self._spent += used - ahead
                    self.write_cpu_s += used
                    self._per_block += 0.2 * (used / (copy.blocks + 1) - self._per_block)
                    self._count.notify_all()

    def stats(self) -> CheckpointStats:
        """The checkpoints' state for the collector's snapshot."""
        if not self.enabled:
            return CheckpointStats(state="off")
        return msgspec.structs.replace(self.store.stats(), round_seconds=self.round_seconds)
