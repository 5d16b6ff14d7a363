"""A request trace replayed across the ranks of one pool: a router, and the truth of every lookup.

Pure logic: no sockets, no clocks (the trace's milliseconds and the wall time of a store are
passed in). `TraceReplay.serve` routes one request to a rank, runs it through that rank's prefix
cache (`SimStream.admit`: hits touched, unpinned leaves evicted LRU first, the missed pages
stored, every resident page of the request held until it has decoded its output), and counts,
per rank and for the pool, what each lookup was, in trace blocks and in engine pages:

- hit: resident on the rank the request went to (the leading run: a prefix cache stops at the
  first miss, and a tree that evicts leaves first holds no page whose parent it lost);
- compulsory: a miss of a page never resident anywhere in the pool before;
- capacity: resident before somewhere in the pool, evicted everywhere since;
- placement: resident now on another rank of the pool.

A trace block is a hit when every page of it the engine caches is resident; otherwise it counts
as the kind of its first missed page. A block with no page the engine caches (vLLM keeps full
blocks only, so a last block shorter than one page) is never resident: compulsory, always.
"Ever resident" is kept per trace block as the length of the page prefix that ever was: a page
is stored only while its parent is resident, so the pages of a block ever resident are a prefix.

`replay_offline` runs a whole trace in-process, batch by batch as the publisher would send them,
for tests and benchmarks.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvobserve.simulate.cache import Page
from kvobserve.simulate.encoders import WireFormat, get_format
from kvobserve.simulate.faults import FaultConfig
from kvobserve.simulate.stream import SimStream
from kvobserve.simulate.trace import TRACE_BLOCK_TOKENS, RequestPages, TraceRequest, request_pages

ROUTES = ("round_robin", "random", "kv_aware")
# kv_aware skips ranks with more requests in flight than the least loaded one plus this, as
# cache-aware routers balance load before affinity (otherwise one system prompt that every
# request shares would draw the whole trace to the first rank that cached it)
KV_AWARE_BALANCE = 8
KINDS = ("compulsory", "capacity", "placement")


@dataclass(slots=True)
class Lookups:
    """Lookups of one unit (trace blocks or engine pages) and what each one was."""

    lookups: int = 0
    hits: int = 0
    compulsory: int = 0
    capacity: int = 0
    placement: int = 0

    def add(self, other: Lookups) -> None:
        """Add another count into this one."""
        self.lookups += other.lookups
        self.hits += other.hits
        self.compulsory += other.compulsory
        self.capacity += other.capacity
        self.placement += other.placement

    def as_dict(self) -> dict[str, int]:
        """The counts as the truth file has them."""
        return {
            "lookups": self.lookups,
            "hits": self.hits,
            "compulsory": self.compulsory,
            "capacity": self.capacity,
            "placement": self.placement,
        }


@dataclass(slots=True)
class RankTruth:
    """What the requests routed to one rank looked up."""

    dp_rank: int
    requests: int = 0
    prompt_tokens: int = 0
    blocks: Lookups = field(default_factory=Lookups)
    pages: Lookups = field(default_factory=Lookups)
    unstored_pages: int = 0  # missed but not stored: no room beside the pages requests held

    def as_dict(self) -> dict[str, Any]:
        """The rank's truth."""
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "blocks": self.blocks.as_dict(),
            "pages": self.pages.as_dict(),
            "unstored_pages": self.unstored_pages,
        }


def leading_resident(nodes: dict[Any, Any], pages: Sequence[Page]) -> int:
    """How many leading pages of a request a rank's cache holds."""
    n = 0
    for p in pages:
        if p.hash not in nodes:
            break
        n += 1
    return n


class Router:
    """Picks the rank of the pool a request goes to."""

    def __init__(self, route: str, seed: int, balance: int = KV_AWARE_BALANCE) -> None:
        if route not in ROUTES:
            raise ValueError(f"route: {route!r} is not {', '.join(ROUTES)}")
        self.route = route
        self.balance = balance
        self._rng = random.Random(seed)
        self._next = 0

    def pick(self, pages: Sequence[Page], streams: Sequence[SimStream]) -> int:
        """The index in `streams` of the rank to serve the request.

        kv_aware: the rank holding the most leading pages of the request; among equals the one
        with the fewest requests in flight, then the lowest index; ranks with more than
        `balance` requests in flight above the least loaded one are passed over.
        """
        if self.route == "round_robin":
            i = self._next % len(streams)
            self._next += 1
            return i
        if self.route == "random":
            return self._rng.randrange(len(streams))
        least = min(s.in_flight for s in streams)
        best, best_key = 0, (-1, 0)
        for i, s in enumerate(streams):
            if s.in_flight > least + self.balance:
                continue  # overloaded: a prefix every request shares would draw them all here
            key = (leading_resident(s.cache.nodes, pages), -s.in_flight)
            if key > best_key:
                best, best_key = i, key
        return best


class TraceReplay:
    """Serve trace requests, in order, on the ranks of one pool; count the truth."""

    def __init__(
        self,
        fmt: WireFormat,
        page_size: int,
        route: str,
        seed: int,
        decode_tokens_per_s: float,
        streams: Callable[[], Sequence[SimStream]],
        dp_ranks: Sequence[int],
    ) -> None:
        if TRACE_BLOCK_TOKENS % page_size:
            raise ValueError(
                f"page_size: {page_size} must divide the trace's {TRACE_BLOCK_TOKENS}-token blocks"
            )
        self.fmt = fmt
        self.page_size = page_size
        self.router = Router(route, seed)
        self.decode_tokens_per_s = decode_tokens_per_s
        self._streams = streams  # the pool's current instances (a restart replaces one)
        self.ranks = [RankTruth(r) for r in dp_ranks]
        self._ever: dict[int, int] = {}  # trace block id -> pages of it ever resident (a prefix)
        self.served = 0
        self.trace_ms = 0  # the trace time of the last request served

    def serve(self, req: TraceRequest, wall_ts: float, rp: RequestPages | None = None) -> int:
        """Route and serve one request at its trace time; the index of the rank it went to
        (`rp`: its pages, when the caller made them already)."""
        now = req.timestamp_ms
        streams = self._streams()
        for s in streams:
            s.finish_until(now)
        if rp is None:
            rp = request_pages(req, self.fmt.hash_kind, self.page_size, self.fmt.per_page_stores)
        pages, ends = rp.pages, rp.ends
        i = self.router.pick(pages, streams)
        target = streams[i]
        others = [s.cache.nodes for s in streams if s is not target]
        end = now + (req.output_length * 1000 / self.decode_tokens_per_s if
                     self.decode_tokens_per_s > 0 else 0)  # fmt: skip
        target._ts = wall_ts
        assert target.outbox is not None
        res = target.admit(pages, req.input_length, end, target.outbox)
        hit = res.hit_pages
        t = self.ranks[i]
        t.requests += 1
        t.prompt_tokens += req.input_length
        t.unstored_pages += len(pages) - hit - len(res.stored)
        # the kind of every missed page (others' caches are as before: only the target changed)
        ever = self._ever
        kinds: list[int] = []
        start = 0
        for b, stop in zip(req.hash_ids, ends, strict=True):
            seen = ever.get(b, 0)
            for j in range(max(hit, start), stop):
                h = pages[j].hash
                if any(h in o for o in others):
                    kinds.append(2)
                elif j - start < seen:
                    kinds.append(1)
                else:
                    kinds.append(0)
            start = stop
        self._count(t, req, ends, hit, kinds)
        # then the pages now resident (the hit prefix and what was stored) were resident
        resident = hit + len(res.stored)
        start = 0
        for b, stop in zip(req.hash_ids, ends, strict=True):
            if resident <= start:
                break
            n = min(resident, stop) - start
            if n > ever.get(b, 0):
                ever[b] = n
            start = stop
        self.served += 1
        self.trace_ms = now
        return i

    def _count(
        self, t: RankTruth, req: TraceRequest, ends: list[int], hit: int, kinds: list[int]
    ) -> None:
        pages, blocks = t.pages, t.blocks
        pages.lookups += ends[-1] if ends else 0
        pages.hits += hit
        for k in kinds:
            _bump(pages, k, 1)
        blocks.lookups += len(req.hash_ids)
        start = 0
        for stop in ends:
            if start < stop <= hit:
                blocks.hits += 1
            elif stop == start:
                blocks.compulsory += 1  # nothing of it is ever cached
            else:
                _bump(blocks, kinds[max(hit, start) - hit], 1)
            start = stop

    def pool(self) -> RankTruth:
        """The pool's sums."""
        total = RankTruth(-1)
        for t in self.ranks:
            total.requests += t.requests
            total.prompt_tokens += t.prompt_tokens
            total.blocks.add(t.blocks)
            total.pages.add(t.pages)
            total.unstored_pages += t.unstored_pages
        return total

    def truth(self) -> dict[str, Any]:
        """Per rank and for the pool: requests, lookups, hits and misses by kind, both units."""
        pool = self.pool().as_dict()
        return {
            "route": self.router.route,
            "page_size": self.page_size,
            "requests_served": self.served,
            "trace_ms": self.trace_ms,
            "pool": pool,
            "ranks": {str(t.dp_rank): t.as_dict() for t in self.ranks},
        }


def _bump(c: Lookups, kind: int, n: int) -> None:
    if kind == 0:
        c.compulsory += n
    elif kind == 1:
        c.capacity += n
    else:
        c.placement += n


@dataclass
class OfflineRun:
    """A trace replayed in-process: the replay (its truth) and the pool's publisher instances."""

    replay: TraceReplay
    streams: list[SimStream]


def replay_offline(
    requests: Iterable[TraceRequest],
    *,
    format: str = "sglang-0.5.23",
    ranks: int = 1,
    capacity_tokens: int = 16_384,
    page_size: int = 16,
    route: str = "round_robin",
    seed: int = 0,
    decode_tokens_per_s: float = 20.0,
    on_batch: Callable[[int, int, bytes], None] | None = None,
    on_start: Callable[[list[SimStream]], None] | None = None,
) -> OfflineRun:
    """Replay `requests` as fast as it goes on `ranks` ranks of one pool, without sockets.

    After each request the rank it went to publishes one batch (what `SimulatedWorker` would
    send at its next tick); `on_batch(dp_rank, seq, payload)` gets each one in that order, so a
    consumer sees every rank's events in the order the simulator made them (`on_start` gets the
    ranks' publisher instances first: their hit counters as they go). The batch ts is the
    request's trace time in seconds plus one millisecond per request before it (so that every
    batch has a millisecond of its own, though the trace's requests share whole seconds: 12 s
    late at the end of the fixture, always in the trace's order).
    """
    fmt = get_format(format)
    streams = [
        SimStream(fmt, f"{r}.0", "primary", r, r, b"", None, seed * 1009 + r, capacity_tokens,
                  page_size, 1, FaultConfig())
        for r in range(ranks)
    ]  # fmt: skip
    for s in streams:
        s.outbox = []
    replay = TraceReplay(
        fmt, page_size, route, seed, decode_tokens_per_s, lambda: streams, range(ranks)
    )
    if on_start is not None:  # a consumer that reads the engines' counters as it goes
        on_start(streams)
    for n, req in enumerate(requests):
        ts = req.timestamp_ms / 1000.0 + n * 1e-3
        i = replay.serve(req, ts)
        out = streams[i].next_batch(ts)
        if out is not None and on_batch is not None:
            on_batch(i, int.from_bytes(out[0], "big"), out[1])
    return OfflineRun(replay, streams)


def replay_capacities(
    requests: Iterable[TraceRequest],
    capacities: Sequence[int],
    *,
    format: str = "sglang-0.5.23",
    page_size: int = 16,
    decode_tokens_per_s: float = 20.0,
) -> dict[int, RankTruth]:
    """The truth of one cache of each capacity (tokens) serving every request of the trace:
    what a pool run as one cache of that size, or one rank with that much memory, would have
    hit (the judge of the capacity curve, docs/cache-analytics.md). The caches run side by
    side on each request's pages, made once; no batch is encoded."""
    fmt = get_format(format)
    runs: list[tuple[TraceReplay, SimStream]] = []
    for cap in capacities:
        st = SimStream(fmt, "0.0", "primary", 0, 0, b"", None, 0, cap, page_size, 1, FaultConfig())
        st.outbox = []
        one: list[SimStream] = [st]
        replay = TraceReplay(fmt, page_size, "round_robin", 0, decode_tokens_per_s,
                             one.copy, [0])  # fmt: skip
        runs.append((replay, st))
    for n, req in enumerate(requests):
        ts = req.timestamp_ms / 1000.0 + n * 1e-3
        rp = request_pages(req, fmt.hash_kind, page_size, fmt.per_page_stores)
        for replay, st in runs:
            replay.serve(req, ts, rp)
            assert st.outbox is not None
            st.outbox.clear()
    return {cap: replay.ranks[0] for cap, (replay, _) in zip(capacities, runs, strict=True)}
