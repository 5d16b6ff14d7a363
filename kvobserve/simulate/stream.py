"""One publisher instance: request arrivals into a prefix cache, events, seq, replay ring, faults.

Pure logic (time is passed in). Each batch is encoded once; the same bytes go live, into the ring,
to a mirror port and to replay.
"""

from __future__ import annotations

import heapq
import random
from array import array
from collections import deque
from typing import Any

from kvobserve.simulate.cache import (
    Hash,
    InsertResult,
    Page,
    PrefixCache,
    PromptLibrary,
    paginate,
)
from kvobserve.simulate.encoders import encode_batch
from kvobserve.simulate.faults import MALFORMED_PAYLOADS, Action, FaultConfig, FaultPlan
from kvobserve.simulate.ledger import CpuTier, Ledger
from kvobserve.simulate.wire_format import WireFormat

_POOL_SIZE = 1 << 16
PREFILL_US_PER_TOKEN = 5  # made-up prefill cost for LoadStat's busy counter


class SimStream:
    """A publisher instance (`instance` label) of one rank; its seq starts at 0."""

    def __init__(
        self,
        fmt: WireFormat,
        instance: str,
        kind: str,
        rank: int,
        label: int,
        topic: bytes,
        library: PromptLibrary | None,
        seed: int,
        capacity_tokens: int,
        page_size: int,
        buffer_steps: int,
        faults: FaultConfig,
        requests_per_batch: int = 1,
        output_tokens: int = 48,
        flush_every: int = 0,
        max_running: int = 48,
        cpu_tier_tokens: int = 0,
    ) -> None:
        self.fmt = fmt
        self.instance = instance
        self.kind = kind
        self.rank = rank
        self.label = label
        self.topic = topic
        self.library = library
        self.cache = PrefixCache(capacity_tokens)
        self.page_size = page_size
        self.ring: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_steps)
        self.plan = FaultPlan(faults, rank, seed ^ 0x5EED)
        self.requests_per_batch = requests_per_batch
        self.output_tokens = output_tokens
        self.flush_every = flush_every
        self.max_running = max_running
        self._rng = random.Random(seed)
        # generated tokens are windows of one random pool: cheap per request, unique via the chain
        self._pool = list(array("H", self._rng.randbytes(2 * _POOL_SIZE)))
        # running requests: a heap of (tick at which each ends, id); the pages each one holds
        # (oldest first; a flush empties the lists, a preemption removes the request)
        self._ends: list[tuple[float, int]] = []
        self._live: dict[int, list[Hash]] = {}
        self._tick = 0  # next_batch calls: request lifetimes count these, not seqs
        self.preempted = 0
        self._medium = fmt.wire_medium("GPU")
        self.gpu = self._medium or "GPU"  # the medium's name in the truth (None on the wire: GPU)
        # the host tier (off by default, so existing formats keep their bytes)
        self.cpu = CpuTier(cpu_tier_tokens) if cpu_tier_tokens else None
        self.cpu_medium = fmt.cpu_medium
        self._page_tokens: dict[Hash, int] = {}  # GPU pages' token counts (CPU tier only)
        self.ledger = Ledger()
        self.peers: list[SimStream] = []  # the node's other ranks (recompute-elsewhere truth)
        self._ts = 0.0  # the batch being made
        self.made = 0  # batches made, numbered or not
        self.unnumbered_dropped: list[int] = []  # `made` indexes dropped before numbering
        self.seq = 0
        self.batches_sent = 0
        self.events = 0
        self.live_dropped: list[int] = []
        self.ring_dropped: list[int] = []
        self.malformed: list[int] = []
        self.query_tokens = 0
        self.hit_tokens = 0
        self.prefill_uncached_tokens = 0
        self.requests = 0
        self._batch_query = 0  # prompt tokens of the requests since the last batch
        self._batch_hit = 0
        self.batch_hit_rate = 0.0  # hit tokens / prompt tokens of the last prefill batch
        # a replayed trace's requests (simulate/replay.py) put their events here; None: the
        # stream makes its own requests from the prompt library
        self.outbox: list[Any] | None = None
        self.ended = False  # a restarted instance keeps its final state here

    # --- workload -----------------------------------------------------------------------------

    def _request(self, out: list[Any]) -> None:
        """One request arrives: prompt + generated tokens go through the cache; events to `out`."""
        rng = self._rng
        assert self.library is not None
        prompt = self.library.sample(rng)
        fmt = self.fmt
        n_out = rng.randint(0, 2 * self.output_tokens) if self.output_tokens else 0
        pages = prompt
        if n_out:
            o = rng.randrange(_POOL_SIZE - n_out)
            pages = prompt + paginate(
                fmt.hash_kind, self._pool[o : o + n_out], self.page_size, prompt[-1].digest,
                keep_partial=fmt.per_page_stores,
            )  # fmt: skip
        prompt_tokens = sum(len(p.tokens) for p in prompt)
        self.admit(pages, prompt_tokens, self._tick + rng.randint(4, 64), out, n_out)

    def admit(
        self, pages: list[Page], prompt_tokens: int, end: float, out: list[Any], extra: int = 0
    ) -> InsertResult:
        """Serve one request on these pages: look up, evict, store what missed, hold the
        resident pages until `end` (`finish_until`); events to `out`. `extra`: tokens beyond
        the pages the request will need (its generated tokens), for the room check."""
        fmt = self.fmt
        cache = self.cache
        if cache.locked_tokens + prompt_tokens + extra > cache.capacity_tokens:
            self._make_room(pages)  # only near capacity: the exact demand costs a walk
        res = cache.insert(pages)
        self.requests += 1
        self.query_tokens += prompt_tokens
        # the engines compute at least the last prompt token, so a hit stops a page short of it
        hit = min(res.hit_tokens, prompt_tokens - 1 - (prompt_tokens - 1) % self.page_size)
        self.hit_tokens += max(hit, 0)
        self._batch_query += prompt_tokens
        self._batch_hit += max(hit, 0)
        # the request holds what is resident of its sequence: the hit prefix and what was stored
        held = [p.hash for p in pages[: res.hit_pages + len(res.stored)]]
        cache.lock(held)
        self._live[self.requests] = held
        heapq.heappush(self._ends, (end, self.requests))
        n = self.requests
        meta = fmt.request_meta(n, (), self.page_size) if fmt.per_page_stores else None
        if self.cpu is not None:  # loads first: a page being loaded is not evicted meanwhile
            onboards = sum(1 for p in res.stored if self.cpu.onboard(p.hash))
            if onboards:
                self.ledger.moved(f"{self.cpu_medium}>{self.gpu}", onboards)
            self._offload(res.evicted, out)
        for run in res.evicted:
            if fmt.removed_per_node:
                out.append(fmt.removed(run[::-1], self._medium))
            else:
                out.extend(fmt.removed([h], self._medium) for h in run)
            self.ledger.removed(self.gpu, run, self._ts)
        if not res.stored:
            return res
        stored_hashes = [p.hash for p in res.stored]
        if self.peers:
            self.ledger.recomputed_elsewhere += sum(
                1 for h in stored_hashes if any(h in o.cache.nodes for o in self.peers)
            )
        if self.cpu is not None:
            self._page_tokens.update((p.hash, len(p.tokens)) for p in res.stored)
        stored_tokens = sum(len(p.tokens) for p in res.stored)
        self.prefill_uncached_tokens += stored_tokens
        parent: Hash | None = res.parent if res.parent is not None else fmt.root_parent
        if meta is not None:  # SGLang: the metadata is per request, not per page
            self.ledger.stored(self.gpu, stored_hashes, self._ts, meta.lora_name)
            for p in res.stored:
                out.append(
                    fmt.stored([p.hash], parent, p.tokens, len(p.tokens), self._medium, meta)
                )
                parent = p.hash
        else:
            tokens = [t for p in res.stored for t in p.tokens]
            hashes = [p.hash for p in res.stored]
            meta = fmt.request_meta(n, tokens, self.page_size)
            self.ledger.stored(self.gpu, stored_hashes, self._ts, meta.lora_name)
            out.append(fmt.stored(hashes, parent, tokens, self.page_size, self._medium, meta))
        return res

    def _offload(self, evicted: list[list[Hash]], out: list[Any]) -> None:
        """Copy the GPU's evicted pages to the host tier, before the GPU frees them."""
        assert self.cpu is not None
        fmt, cpu, medium, ledger = self.fmt, self.cpu, self.cpu_medium, self.ledger
        pages = [(h, self._page_tokens.pop(h, self.page_size)) for run in evicted for h in run]
        stored, dropped = cpu.offload(pages)
        if dropped:
            for h in dropped:
                out.append(fmt.removed([h], medium))
            unread = sum(1 for h in dropped if h not in cpu.read_back)
            cpu.read_back.difference_update(dropped)
            ledger.unread_removed[medium] = ledger.unread_removed.get(medium, 0) + unread
            ledger.removed(medium, dropped, self._ts)
        if not stored:
            return
        if fmt.per_page_stores:
            out.extend(fmt.stored([h], None, [], k, medium) for h, k in stored)
        else:
            out.append(fmt.stored([h for h, _ in stored], None, [], self.page_size, medium))
        ledger.stored(medium, [h for h, _ in stored], self._ts)
        ledger.moved(f"{self.gpu}>{medium}", len(stored))

    def _make_room(self, pages: list[Page]) -> None:
        """Preempt the newest running requests until this one's pages fit beside the held ones.

        The engines do the same under memory pressure (vLLM preempts, SGLang retracts); with the
        default workload it never happens. A request larger than the cache stores what fits.
        """
        cache, live = self.cache, self._live
        while cache.locked_tokens + cache.demand(pages) > cache.capacity_tokens:
            victim = next((rid for rid in reversed(live) if live[rid]), None)
            if victim is None:
                return
            cache.unlock(live.pop(victim))
            self.preempted += 1

    def finish_until(self, now: float) -> None:
        """Requests whose end is at or before `now` end and let go of their pages (the clock is
        batches made, or the trace's milliseconds for a replayed trace)."""
        ends, live = self._ends, self._live
        while ends and ends[0][0] <= now:
            held = live.pop(heapq.heappop(ends)[1], None)  # None: preempted before
            if held:
                self.cache.unlock(held)

    def _flush_due(self) -> bool:
        return bool(self.flush_every and self.seq and self.seq % self.flush_every == 0)

    def _close_prefill_batch(self) -> None:
        """The requests admitted since the last batch were one prefill batch (SGLang's gauge)."""
        if self._batch_query:
            self.batch_hit_rate = self._batch_hit / self._batch_query
            self._batch_query = self._batch_hit = 0

    def _events(self) -> list[Any]:
        if self._flush_due():
            self.cache.clear()
            if self.cpu is not None:
                self.cpu.clear()
                self._page_tokens.clear()
            self.ledger.cleared()
            for rid in self._live:  # a flush frees every page; the running requests go on
                self._live[rid] = []
            return [self.fmt.cleared]
        self._close_prefill_batch()
        if self.outbox is not None:  # a replayed trace: what its requests did since the last batch
            queued, self.outbox = self.outbox, []
            return queued
        out: list[Any] = []
        # an all-hit request produces no event and engines publish no empty batch: try a few more
        for i in range(self.requests_per_batch + 8):
            self._request(out)
            if out and i >= self.requests_per_batch - 1:
                break
        return out

    # --- publishing ---------------------------------------------------------------------------

    def step_events(self) -> list[Any]:
        """Advance one engine step and return its events unencoded (a Dynamo relay re-publishes
        them); no seq-based faults (the relay has its own), empty when nothing changed."""
        self._tick += 1
        self.finish_until(self._tick)
        events = self._events()
        self.seq += 1
        self.events += len(events)
        self.batches_sent += bool(events)
        return events

    def next_batch(self, ts: float) -> tuple[bytes, bytes] | None:
        """Advance one batch: (seq frame, payload) to send live, or None (dropped or no events)."""
        seq = self.seq
        self._tick += 1
        self._ts = ts
        if self.outbox is not None:  # a replayed trace ends its requests on the trace's clock
            if not self.outbox and not self._flush_due():
                self._close_prefill_batch()  # fully hit requests: a prefill without events
                return None  # nothing happened since the last batch: no batch is made
        else:
            self.finish_until(self._tick)
        made = self.made
        self.made += 1
        if self.plan.drops_unnumbered(made):
            if self._events():  # made and lost before a seq was assigned: no gap shows
                self.unnumbered_dropped.append(made)
            return None
        action = self.plan.decide(seq)
        if action is Action.MALFORMED:
            payload = MALFORMED_PAYLOADS[len(self.malformed) % len(MALFORMED_PAYLOADS)]
            self.malformed.append(seq)
        else:
            events = self._events()
            if not events:
                return None
            self.events += len(events)
            payload = encode_batch(ts, events, self.label)
        seq_b = seq.to_bytes(8, "big")
        self.seq = seq + 1
        if action is Action.RING_DROP:
            self.ring_dropped.append(seq)
            return None
        self.ring.append((seq, seq_b, payload))
        if action is Action.LIVE_DROP:
            self.live_dropped.append(seq)
            return None
        self.batches_sent += 1
        return seq_b, payload

    # --- scheduler view -----------------------------------------------------------------------

    @property
    def running(self) -> int:
        """Requests running now (capped at max_running_requests)."""
        return min(len(self._live), self.max_running)

    @property
    def waiting(self) -> int:
        """Requests queued behind the running ones."""
        return max(0, len(self._live) - self.max_running)

    @property
    def in_flight(self) -> int:
        """Requests admitted and not finished (a router's load)."""
        return len(self._live)

    @property
    def held_tokens(self) -> int:
        """KV tokens the running requests hold: what the engines' scheduler reports as used."""
        return self.cache.locked_tokens

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit rate over all prompt tokens so far."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
