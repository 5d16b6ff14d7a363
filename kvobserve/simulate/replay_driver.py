"""The clock and thread of a trace replay across every node of one simulated worker.

Requests are served at their trace times divided by `speed` (0: as fast as the publishers take
them: the replay waits while a rank has more than `MAX_PENDING` events not yet published), after
`start_delay_s` (observers connect first). Each request is served holding every node's lock, so
a publisher thread never sees a rank half-way through a request; its events wait in the rank's
outbox until that rank's next batch. After the last request the workers keep serving (side
channels, replay, HTTP) until they are stopped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from kvobserve.simulate.ranks import RankState
from kvobserve.simulate.replay import TraceReplay, replay_capacities
from kvobserve.simulate.trace import TraceRequest
from kvobserve.simulate.worker import SimulatedWorker

MAX_PENDING = 50_000  # events waiting in one rank's outbox before an unpaced replay waits


class TraceDriver:
    """Replays `requests` on the ranks of `workers` (the nodes of one worker); `start`, `stop`."""

    def __init__(self, workers: Sequence[SimulatedWorker], requests: Sequence[TraceRequest]):
        self.workers = sorted(workers, key=lambda w: w.cfg.node_rank)
        self.cfg = self.workers[0].cfg
        self.requests = requests
        self._ranks: list[RankState] = []
        self.replay: TraceReplay | None = None  # made at start(), once the ranks exist
        self.done = False
        # cfg.truth_capacities: factor -> one cache of factor x the pool's capacity, once done
        self.capacities: dict[str, dict[str, Any]] | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the replay's counts: serve() against truth()
        self._thread: threading.Thread | None = None

    def start(self) -> TraceDriver:
        """Start replaying in a background thread (after the workers' start delay); the
        workers must have started (their ranks exist)."""
        c = self.cfg
        ranks = self._ranks = sorted(
            (st for w in self.workers for st in w.ranks if st.mirror_of is None),
            key=lambda st: st.rank,
        )
        self.replay = TraceReplay(
            c.wire, c.page_size, c.route, c.seed, c.decode_tokens_per_s,
            lambda: [st.streams[0] for st in ranks], [st.rank for st in ranks],
        )  # fmt: skip
        self._thread = threading.Thread(target=self._run, name=f"trace-{c.worker_id}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        c, replay = self.cfg, self.replay
        assert replay is not None
        start = time.monotonic() + c.start_delay_s
        if self._stop.wait(c.start_delay_s):
            return
        first = self.requests[0].timestamp_ms if self.requests else 0
        locks = [w.lock for w in self.workers]
        for req in self.requests:
            if c.speed > 0:
                due = start + (req.timestamp_ms - first) / 1000.0 / c.speed
                while (left := due - time.monotonic()) > 0:
                    if self._stop.wait(min(left, 0.1)):
                        return
            else:
                while self._backlog():
                    if self._stop.wait(0.002):
                        return
            if self._stop.is_set():
                return
            for lock in locks:
                lock.acquire()
            try:
                with self._lock:
                    replay.serve(req, time.time())
            finally:
                for lock in reversed(locks):
                    lock.release()
        self.done = True
        if c.truth_capacities:
            self._capacities()

    def _capacities(self) -> None:
        """The truth of one cache of each factor x the pool's total capacity (in this thread,
        after the replay: the judge of the capacity curve, docs/cache-analytics.md)."""
        c = self.cfg
        total = c.capacity_tokens * len(self._ranks)
        sizes = [int(f * total) for f in c.truth_capacities]
        got = replay_capacities(self.requests, sizes, format=c.format, page_size=c.page_size,
                                decode_tokens_per_s=c.decode_tokens_per_s)  # fmt: skip
        out = {}
        for f, size in zip(c.truth_capacities, sizes, strict=True):
            t = got[size]
            out[f"{f:g}"] = {
                "capacity_tokens": size,
                "pages": {"lookups": t.pages.lookups, "hits": t.pages.hits},
                "blocks": {"lookups": t.blocks.lookups, "hits": t.blocks.hits},
                "hit_rate": t.pages.hits / t.pages.lookups if t.pages.lookups else None,
            }
        with self._lock:
            self.capacities = out

    def _backlog(self) -> bool:
        return any(len(st.streams[0].outbox or ()) > MAX_PENDING for st in self._ranks)

    def truth(self) -> dict[str, Any]:
        """The replay's truth now: per rank and for the pool (simulate/replay.py)."""
        with self._lock:
            doc = self.replay.truth() if self.replay is not None else {}
        pending = sum(len(st.streams[0].outbox or ()) for st in self._ranks)
        out = {
            "worker_id": self.cfg.worker_id,
            "trace": self.cfg.trace,
            "speed": self.cfg.speed,
            "requests": len(self.requests),
            "done": self.done,
            "pending_events": pending,  # served, not yet published
            **doc,
        }
        if self.capacities is not None:
            out["capacities"] = self.capacities
        return out

    def stop(self, timeout: float = 2.0) -> None:
        """Stop replaying (the workers are stopped by their owner); idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
