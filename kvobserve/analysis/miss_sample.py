"""Where the misses come from, across collectors: hash-sampled exact sets.

Within one collector `PoolMisses` (analysis/misses.py) reads every rank's resident set in place.
A pool whose ranks several collectors watch (multi-node DP) needs the other collectors'
residency, and shipping every store and removal would cost far more than the snapshots. So each
collector ships only the changes of the blocks in a *sample* (`MissSampler`, as `MissDelta`,
wire/misses.py), and the aggregator replays every collector's sampled changes in engine-time
order and classifies each sampled store exactly as `PoolMisses` does (`SampledSplit`).

The sample is geometric in the block hash. A hash's 64-bit key (`placement.hash_key`; the
engines' hashes are already uniform) falls in bucket `b` = its leading zeros, with probability
2^-(b+1); at level `L` the blocks of buckets >= L are in the sample (probability 2^-L). A block
is in or out of it on every rank and collector alike, so its whole history is followed: a sampled
store is classified exactly, given the order. Counts are kept per bucket, so raising the level
drops exactly the buckets that left: what remains is a uniform 2^-L sample of every store since
the start.

The level keeps the sample small and large enough. It starts at 1 (half the blocks), so a
pool's first 10,000 stores give 5,000 sampled misses; the aggregator raises it while the pool's
sampled misses exceed `2 * floor`, so at least `floor` (4,000) of them stand behind the pool's
shares from then on and its sets hold at most about `2 * floor` blocks, however large the pool:
the error of a share p is the binomial z * sqrt(p (1 - p) / n) (at most 1.55 points at n =
4,000 at 95 %; the bound is at 99 %, BOUND_Z, since a workload keeps its draw of the sample; a
block stored many times is sampled with all its stores, which widens it a little:
docs/cache-analytics.md has the measured spread), plus what the order across collectors gets
wrong (engine timestamps within one delta interval). The aggregator tells the collectors the pool's
level (`MissSampler.follow`, a few bytes per interval), and a collector raises its own while its
own sampled stores alone exceed `2 * floor`: it ships what the aggregator needs and never less
(the aggregator's level is the highest of its own and every collector's). What the collectors
of a pool ship over a run grows with the logarithm of the stores, not with their rate: about
`floor` sampled stores and as many removals, 10 bytes a record, per doubling of the stores, not with the store rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvobserve.analysis.capacity import RankCurve
from kvobserve.analysis.capacity_pool import PoolGhosts
from kvobserve.analysis.placement import hash_key
from kvobserve.analysis.tiers import TOP_MEDIA
from kvobserve.wire.kv_events import BlockHash, KvBatch
from kvobserve.wire.misses import CLEAR, REMOVE, STORE, MissDelta, Op, iter_ops, pack_op

FLOOR = 4000  # sampled misses behind a pool's shares: 1.55 points at 95 %, 2.04 at 99 %
# The bound's z: 99 %. The sample is the blocks whose hash falls in it: fixed by a workload's
# content, so one workload's estimate errs the same way in every run, and a 95 % bound would leave
# one workload in twenty outside it for good (the conversation trace with the engines' own
# hashes is one: 1.53 points off against a 95 % bound of 1.26; docs/cache-analytics.md).
BOUND_Z = 2.576
# the first level: a pool's first 10,000 stores (the target's) give 5,000 >= FLOOR sampled misses
START_LEVEL = 1
BUCKETS = 65  # leading zeros of a 64-bit key: 0 .. 64
_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
_SIGN = 1 << 63
KIND_NAMES = ("compulsory", "capacity", "placement")


def bucket_of(key: int) -> int:
    """The sample bucket of a 64-bit key: its leading zeros (64 for key 0)."""
    return 64 - key.bit_length()


def ident_bucket(ident: int) -> int:
    """The bucket of a sampled block's identity (the top 48 bits of its key; 48 and up: 48)."""
    return 48 - ident.bit_length()


Rank = tuple[str, int]  # (worker_id, dp_rank): a rank of a pool (a pool may hold several workers)


class MissSampler:
    """Collector side: the sampled top-tier changes of one pool's ranks in this collector.

    Feed it every applied batch of those ranks (`observe`, or a rank's `tap` from its
    sequencer), in the order the collector applies them; take a `delta` every interval. A rank
    is (worker_id, dp_rank), or a bare dp rank of the worker named as the pool. `salt` (0 in
    production: the engines' hashes are uniform) re-draws the sample, for measuring the
    estimator's spread.
    """

    def __init__(
        self,
        pool: str,
        signed: bool,
        floor: int = FLOOR,
        salt: int = 0,
        start_level: int = START_LEVEL,
    ) -> None:
        self.pool = pool
        self.signed = signed
        self.floor = floor
        self.salt = salt
        self.level = start_level
        self.seq = 0
        self.stores = [0] * BUCKETS  # sampled stores shipped, per bucket
        self._ops = bytearray()
        self._ranks: list[Rank] = []
        self._index: dict[Rank, int] = {}
        # ranks with a capacity curve: the curve, and its stores shipped in the last delta
        self._curves: dict[Rank, RankCurve] = {}
        self._shipped: dict[Rank, int] = {}
        self._base: float | None = None
        self._until: float | None = None  # of the previous delta
        self._limit = self._limit_raw = 0
        self._limit_bytes = b""
        self._set_limit()

    def _set_limit(self) -> None:
        # a raw hash is sampled iff its key < 2^(64 - level): one comparison per hash, in the
        # hash's own type (SGLang's signed ints shifted, 32-byte hashes by their first 8 bytes)
        # (a salted key is computed for every hash instead: `_sampled`)
        limit = self._limit = 1 << (64 - self.level)
        self._limit_raw = limit - _SIGN if self.signed else limit
        self._limit_bytes = limit.to_bytes(9, "big")[1:] if self.level else b"\xff" * 9

    def key(self, h: BlockHash) -> int:
        """The 64-bit sample key of a block hash."""
        k = hash_key(h, self.signed)
        return ((k ^ self.salt) * _MIX) & _MASK if self.salt else k

    def _sampled(self, hashes: list[BlockHash], level: int | None = None) -> list[int]:
        """The keys of the sampled hashes among `hashes` (at `level`, default the sampler's)."""
        if level is None or level == self.level:
            level, raw, lb = self.level, self._limit_raw, self._limit_bytes
        else:
            limit = 1 << (64 - level)
            raw = limit - _SIGN if self.signed else limit
            lb = limit.to_bytes(9, "big")[1:] if level else b"\xff" * 9
        if self.salt:
            limit = 1 << (64 - level)
            return [k for k in map(self.key, hashes) if k < limit]
        if not level:
            return [self.key(h) for h in hashes]
        if hashes and isinstance(hashes[0], bytes):
            return [self.key(h) for h in hashes if h < lb]  # type: ignore[operator]
        return [self.key(h) for h in hashes if h < raw]  # type: ignore[operator]

    def _rank(self, rank: Rank | int) -> Rank:
        return (self.pool, rank) if isinstance(rank, int) else rank

    def _record(self, rank: Rank, ts: float, op: int, keys: list[int]) -> None:
        if self._base is None:  # a batch of another rank may be a little older than this one
            self._base = self._until if self._until is not None else ts - 1.0
        ri = self._index.get(rank)
        if ri is None:
            ri = self._index[rank] = len(self._ranks)
            self._ranks.append(rank)
        ms = round((ts - self._base) * 1e3)
        if op == CLEAR:
            pack_op(self._ops, ms, ri, CLEAR, 0)
            return
        for k in keys:
            pack_op(self._ops, ms, ri, op, k)
            if op == STORE:
                self.stores[bucket_of(k)] += 1

    def observe(self, rank: Rank | int, batch: KvBatch, curve: RankCurve | None = None) -> None:
        """Take the sampled top-tier changes of one applied batch of `rank`; `curve`: the
        rank's capacity curve, handed the keys of its own sample from the same pass."""
        rank = self._rank(rank)
        ts = batch.ts
        for ev in batch.events:
            kind = ev.kind
            if kind == "BlockStored" or kind == "BlockRemoved":
                if (ev.medium or "GPU") not in TOP_MEDIA:  # type: ignore[attr-defined]
                    continue
                hashes = ev.block_hashes  # type: ignore[attr-defined]
                if curve is None:
                    keys = self._sampled(hashes)
                else:  # one pass at the lower level of the two; the other filters its result
                    if curve.level <= self.level:
                        mine = self._sampled(hashes, curve.level)
                        keys = [k for k in mine if k < self._limit] if mine else mine
                    else:
                        keys = self._sampled(hashes)
                        mine = [k for k in keys if k < curve.limit] if keys else keys
                    # the curve's own work only for a sampled block (or its opt-in walk)
                    if kind == "BlockStored":
                        if mine or curve.below is not None:
                            curve.stored(mine, len(hashes), ev.block_size,  # type: ignore[attr-defined]
                                         ev.parent_block_hash, hashes)  # type: ignore[attr-defined]  # fmt: skip
                        else:
                            curve.stores += len(hashes)
                    elif mine or curve.below is not None:
                        curve.removed(mine, hashes)
                    else:
                        curve.evicted += len(hashes)
                if keys:
                    self._record(rank, ts, STORE if kind == "BlockStored" else REMOVE, keys)
            elif kind == "AllBlocksCleared" or (
                kind == "TierCleared" and ev.medium in TOP_MEDIA  # type: ignore[attr-defined]
            ):
                self._record(rank, ts, CLEAR, [])
                if curve is not None:
                    curve.cleared()
        self._maybe_raise()

    def cleared(self, rank: Rank | int, ts: float) -> None:
        """The rank's top tier was emptied without an event (a publisher restart: the reset)."""
        self._record(self._rank(rank), ts, CLEAR, [])

    def tap(self, rank: Rank | int, curve: RankCurve | None = None) -> RankTap:
        """What one rank's sequencer feeds (analysis/sequence.py `BatchTap`); with the rank's
        capacity curve (analysis/capacity.py), fed from the same pass."""
        r = self._rank(rank)
        if curve is not None:
            self._curves[r] = curve
            self._shipped[r] = curve.stores
        return RankTap(self, r, curve)

    def _maybe_raise(self) -> None:
        # alone past what the whole pool needs: the aggregator will be at least this high
        while self.level < 64 and sum(self.stores[self.level :]) > 2 * self.floor:
            self.level += 1
            self._set_limit()

    def follow(self, level: int) -> None:
        """Take the pool's level from the aggregator (`SampledSplit.level`): ship no bucket it
        has dropped."""
        if level > self.level:
            self.level = min(level, 64)
            self._set_limit()

    def _delta(
        self, until: float, base: float, ranks: list[Rank], ops: bytes,
        stored: list[int] | None = None,
    ) -> MissDelta:  # fmt: skip
        self.seq += 1
        workers = [w for w, _ in ranks]
        return MissDelta(
            self.pool, self.seq, self.level, base, until, [r for _, r in ranks], ops,
            workers=[] if all(w == self.pool for w in workers) else workers,
            stored=stored or [],
        )  # fmt: skip

    def delta(self, until: float) -> MissDelta:
        """The changes since the previous delta; every batch at or before `until` (engine
        time) must have been observed."""
        base = self._base if self._base is not None else until
        ranks = list(self._ranks)
        stored: list[int] = []
        if self._curves:  # the exact stores of ranks with a curve, aligned with `ranks`
            new = {r: c.stores - self._shipped.get(r, 0) for r, c in self._curves.items()}
            ranks += [r for r, n in new.items() if n and r not in self._index]
            stored = [new.get(r, 0) for r in ranks]
            self._shipped = {r: c.stores for r, c in self._curves.items()}
        d = self._delta(until, base, ranks, bytes(self._ops), stored)
        self._ops.clear()
        self._ranks.clear()
        self._index.clear()
        self._base = None
        self._until = until
        return d

    def full(self, residents: Mapping[Rank | int, Iterable[BlockHash]], until: float) -> MissDelta:
        """The sampled blocks resident on each rank at `until` (a resync; one pass over the
        ranks' resident sets). Changes not yet taken by `delta` go first, in a delta of their
        own: take one before this."""
        ops = bytearray()
        ranks = [self._rank(r) for r in residents]
        for ri, rank in enumerate(residents):
            for k in self._sampled(list(residents[rank])):
                pack_op(ops, 0, ri, STORE, k)
        d = self._delta(until, until, ranks, bytes(ops))
        d.full = True
        return d


class RankTap:
    """One rank's view of its pool's sampler: what its sequencer calls with every batch it
    applies and when it resets the rank's index; and the rank's capacity curve, if any."""

    __slots__ = ("curve", "rank", "sampler")

    def __init__(self, sampler: MissSampler, rank: Rank, curve: RankCurve | None = None) -> None:
        self.sampler, self.rank, self.curve = sampler, rank, curve

    def observe(self, batch: KvBatch) -> None:
        """An applied batch of this rank."""
        self.sampler.observe(self.rank, batch, self.curve)

    def cleared(self, ts: float) -> None:
        """This rank's index was reset (a new publisher): its top tier is empty."""
        self.sampler.cleared(self.rank, ts)
        if self.curve is not None:
            self.curve.cleared()


@dataclass
class SplitEstimate:
    """The miss split estimated from the sample: shares of the misses, and how far to trust it."""

    sampled: int  # sampled misses behind the shares
    level: int  # the sample is 2^-level of the blocks
    shares: dict[str, float]  # compulsory, capacity, placement: fractions of the misses
    bound: float  # 99 % half-width of the widest share, from the sample itself (below)
    trusted: bool = True
    reason: str = ""  # why not trusted: lost deltas, too few samples (see `reasons`)
    scaled: dict[str, float] = field(default_factory=dict)  # kind -> sampled count * 2^level
    reasons: tuple[str, ...] = ()  # codes: deltas_lost, few_samples


class _ClusterSums:
    """Sums over the sampled blocks (each block's misses c by kind, s their sum) that the
    clusters' variance of a share q of kind i reads: sum (c_i - q s)^2 = A_i - 2 q B_i + q^2 C,
    with A_i = sum c_i^2, B_i = sum c_i s, C = sum s^2; kept as each count grows, so the bound
    costs the same whatever the number of blocks (integers: exact)."""

    __slots__ = ("a", "b", "c")

    def __init__(self) -> None:
        self.a = [0, 0, 0]
        self.b = [0, 0, 0]
        self.c = 0

    @classmethod
    def of(cls, blocks: Iterable[list[int]]) -> _ClusterSums:
        """The sums over `blocks` from scratch (after the level rose and blocks left)."""
        out = cls()
        for per in blocks:
            s = sum(per)
            for i in range(3):
                out.a[i] += per[i] * per[i]
                out.b[i] += per[i] * s
            out.c += s * s
        return out

    def count(self, per: list[int], kind: int) -> None:
        """A block's count of `kind` is about to grow by one (`per`: its counts before)."""
        s = per[0] + per[1] + per[2]
        k = per[kind]
        self.a[kind] += 2 * k + 1
        for i in range(3):
            self.b[i] += per[i]
        self.b[kind] += s + 1
        self.c += 2 * s + 1

    def spread(self, i: int, q: float) -> float:
        """sum over the blocks of (c_i - q s)^2."""
        return max(0.0, self.a[i] - 2 * q * self.b[i] + q * q * self.c)


class SampledSplit:
    """Aggregator side: one pool's sampled residency from every collector's deltas."""

    def __init__(self, floor: int = FLOOR, start_level: int = START_LEVEL) -> None:
        self.floor = floor
        self.level = start_level
        # the pool as one global cache (analysis/capacity_pool.py): told of every block whose
        # last copy left, that entered the pool, or that was stored again after it had left
        self.ghosts = PoolGhosts()
        # rank -> blocks stored, exactly, by ranks whose collector follows their capacity curve
        self.stored: dict[Rank, int] = {}
        self.resident: dict[Rank, set[int]] = {}  # rank -> sampled blocks (48-bit identity)
        self.seen: set[int] = set()  # sampled blocks ever stored on a rank of the pool
        self.counts: dict[Rank, list[list[int]]] = {}  # rank -> kind -> bucket -> misses
        # rank -> kind -> misses, each sampled miss weighed by 2^level when it was classified
        # (unbiased, and it only grows: a counter); since this process started
        self.weighed: dict[Rank, list[float]] = {}
        # sampled block -> its misses by kind, all ranks: the spread of the clusters (`bound`),
        # with the sums over the blocks its variance needs, kept as they change (`_sums`)
        self.per_block: dict[int, list[int]] = {}
        self._sums = _ClusterSums()
        self._pending: dict[str, list[tuple[float, int, Op | MissDelta]]] = {}
        self._until: dict[str, float] = {}
        self._seq: dict[str, int] = {}
        self._start: dict[str, float] = {}  # collector -> its process's start time
        self._order = 0
        self.lost: dict[str, int] = {}  # deltas missed, per collector (cumulative)
        # collectors whose residency here is unknown until their next full delta: a lost
        # delta, or a collector first heard from in mid-run (this aggregator started later)
        self.resync: set[str] = set()
        self.late_ops = 0  # ops older than what was already applied (out of engine-time order)
        self._applied = -math.inf
        self.watermark = -math.inf  # every change at or before this engine time is applied

    # --- input ------------------------------------------------------------------------------

    def add(self, collector: str, d: MissDelta, start: float = 0.0) -> None:
        """Queue one collector's delta (in its seq order; a gap is counted as lost). `start`:
        the collector process's start time (a new process numbers its deltas from 1 again)."""
        if self._start.get(collector, start) != start:
            self._seq.pop(collector, None)  # a new process; its ranks' residency carries on
        self._start[collector] = start
        last = self._seq.get(collector)
        if last is not None and d.seq <= last:
            return  # a duplicate or an old one
        if last is not None and d.seq > last + 1:
            self.lost[collector] = self.lost.get(collector, 0) + d.seq - last - 1
            self.resync.add(collector)
        elif last is None and d.seq > 1:
            self.resync.add(collector)  # heard from in mid-run: what it holds is not known here
        if d.full:
            self.resync.discard(collector)
        self._seq[collector] = d.seq
        if d.level > self.level:
            self._raise(d.level)
        if d.stored:
            for rank, n in zip(d.rank_keys(), d.stored, strict=False):
                self.stored[rank] = self.stored.get(rank, 0) + n
        q = self._pending.setdefault(collector, [])
        if d.full:
            self._order += 1
            q.append((d.until, self._order, d))
        else:
            for op in iter_ops(d):
                self._order += 1
                q.append((op.ts, self._order, op))
        self._until[collector] = max(self._until.get(collector, -math.inf), d.until)

    def forget(self, collector: str) -> None:
        """A collector is gone: apply what it sent, and stop waiting for it (it is waited for
        again from its next delta on)."""
        self.advance(math.inf, only=collector)
        self._until.pop(collector, None)

    def advance(self, watermark: float | None = None, only: str | None = None) -> int:
        """Apply, in engine-time order, every queued op at or before the watermark (default: the
        earliest `until` of the collectors heard from); the number applied."""
        if watermark is None:
            if not self._until:
                return 0
            watermark = min(self._until.values())
            self.watermark = max(self.watermark, watermark)
        ready: list[tuple[float, int, Op | MissDelta]] = []
        for c, q in self._pending.items():
            if only is not None and c != only:
                continue
            if not q:
                continue
            keep = [e for e in q if e[0] > watermark]
            ready.extend(e for e in q if e[0] <= watermark)
            self._pending[c] = keep
        ready.sort(key=lambda e: (e[0], e[1]))
        for ts, _, item in ready:
            if ts < self._applied:
                self.late_ops += 1
            else:
                self._applied = ts
            if isinstance(item, MissDelta):
                self._resync(item)
            else:
                self._apply(item)
        self._maybe_raise()
        return len(ready)

    @property
    def pending(self) -> int:
        """Ops queued, not applied yet (waiting for the watermark)."""
        return sum(len(q) for q in self._pending.values())

    # --- the classification -----------------------------------------------------------------

    def _new_rank(self, rank: Rank) -> set[int]:
        res = self.resident[rank] = set()
        self.counts[rank] = [[0] * BUCKETS for _ in KIND_NAMES]
        self.weighed[rank] = [0.0, 0.0, 0.0]
        return res

    def _apply(self, op: Op) -> None:
        rank = op.rank
        res = self.resident.get(rank)
        if res is None:
            res = self._new_rank(rank)
        if op.op == CLEAR:
            for ident in res:
                if not any(ident in s for r, s in self.resident.items() if r != rank):
                    self.ghosts.left(ident, 0.0, eviction=False)
            res.clear()
            return
        ident = op.key
        bucket = ident_bucket(ident)
        if bucket < self.level:
            return  # left the sample
        if op.op == REMOVE:
            if ident in res:
                res.discard(ident)
                if not any(ident in s for s in self.resident.values()):
                    self.ghosts.left(ident, 1 << self.level)  # its last copy went
            return
        if ident in res:
            return  # stored while resident: no miss
        if any(ident in s for r, s in self.resident.items() if r != rank):
            kind = 2
        elif ident in self.seen:
            kind = 1
            self.ghosts.restored(ident, 1 << self.level)
        else:
            kind = 0
            self.ghosts.entered()
        self.counts[rank][kind][bucket] += 1
        self.weighed[rank][kind] += 1 << self.level
        per = self.per_block.get(ident)
        if per is None:
            per = self.per_block[ident] = [0, 0, 0]
        self._sums.count(per, kind)
        per[kind] += 1
        res.add(ident)
        self.seen.add(ident)

    def _resync(self, d: MissDelta) -> None:
        """A full delta: its ranks hold exactly these sampled blocks now."""
        keys = d.rank_keys()
        fresh: dict[Rank, set[int]] = {r: set() for r in keys}
        for op in iter_ops(d):
            if ident_bucket(op.key) >= self.level:
                fresh[op.rank].add(op.key)
        for rank, blocks in fresh.items():
            if rank not in self.resident:
                self._new_rank(rank)
            self.resident[rank] = blocks
            self.seen.update(blocks)
        union = set().union(*self.resident.values())
        self.ghosts.drop(union)  # resident again: not ghosts
        self.ghosts.resynced(len(union))

    def sampled_misses(self, ranks: Iterable[Rank] | None = None) -> list[int]:
        """Sampled misses by kind over `ranks` (default all), buckets in the sample only."""
        out = [0, 0, 0]
        for r in self.counts if ranks is None else ranks:
            c = self.counts.get(r)
            if c is not None:
                for k in range(3):
                    out[k] += sum(c[k][self.level :])
        return out

    def _maybe_raise(self) -> None:
        level = self.level
        while level < 64:
            total = 0
            for c in self.counts.values():
                for k in range(3):
                    total += sum(c[k][level:])
            if total <= 2 * self.floor:
                break
            level += 1
        if level > self.level:
            self._raise(level)

    def _raise(self, level: int) -> None:
        """Drop the buckets below `level` from the sets (their counts are no longer summed)."""
        self.level = level
        cut = 1 << (48 - level) if level < 48 else 0  # identities >= cut have fewer zeros
        for rank, res in self.resident.items():
            self.resident[rank] = {i for i in res if i < cut}
        self.seen = {i for i in self.seen if i < cut}
        self.per_block = {i: c for i, c in self.per_block.items() if i < cut}
        self._sums = _ClusterSums.of(self.per_block.values())
        g = self.ghosts
        g.drop([i for i in g.stack.held() if i >= cut])
        g.union = len(set().union(*self.resident.values())) if self.resident else 0

    # --- output -----------------------------------------------------------------------------

    def _bound(self, p: list[float], total: int) -> float:
        """99 % half-width of the widest share (BOUND_Z). A sampled block brings all its misses into the
        sample at once (a cluster), so the variance is the clusters' (the ratio estimator's, with
        the pool's blocks as the clusters), never below the binomial one; for a subset of the
        ranks, the binomial one widened by the pool's ratio of the two (its design effect)."""
        pool = self.sampled_misses()
        m = sum(pool)
        blocks = len(self.per_block)
        if m and blocks > 1:
            q = [pool[i] / m for i in range(3)]
            clustered = max(
                self._sums.spread(i, q[i]) * blocks / (blocks - 1) / (m * m) for i in range(3)
            )
            binomial = max(x * (1 - x) for x in q) / m
            deff = max(1.0, clustered / binomial) if binomial else 1.0
        else:
            deff = 1.0
        widest = max(max(x * (1 - x) for x in p), 1.0 / total)  # a share of 0 is not certain
        return BOUND_Z * math.sqrt(deff * widest / total)

    def estimate(self, ranks: Iterable[Rank] | None = None) -> SplitEstimate:
        """The split of the misses of `ranks` (default the pool) as the sample says."""
        n = self.sampled_misses(ranks)
        total = sum(n)
        shares = {k: (n[i] / total if total else 0.0) for i, k in enumerate(KIND_NAMES)}
        scaled = {k: float(n[i] << self.level) for i, k in enumerate(KIND_NAMES)}
        bound = self._bound([n[i] / total for i in range(3)], total) if total else 1.0
        reasons, codes = [], []
        if self.resync:
            lost = sum(self.lost.get(c, 0) for c in self.resync)
            what = f"{lost} deltas lost" if lost else "joined mid-run"
            reasons.append(f"{what}: waiting for a full resync of {', '.join(sorted(self.resync))}")
            codes.append("deltas_lost")
        if total < self.floor:
            reasons.append(f"{total} sampled misses (< {self.floor})")
            codes.append("few_samples")
        return SplitEstimate(total, self.level, shares, bound, not reasons, "; ".join(reasons),
                             scaled, tuple(codes))  # fmt: skip
