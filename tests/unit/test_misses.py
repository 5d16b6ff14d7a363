"""The miss split: exact within a collector, sampled across collectors, against the simulator."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest

from kvobserve.analysis.blocks import BlockIndex
from kvobserve.analysis.miss_sample import (
    BOUND_Z,
    FLOOR,
    START_LEVEL,
    MissSampler,
    SampledSplit,
    ident_bucket,
)
from kvobserve.analysis.misses import PoolMisses
from kvobserve.simulate.replay import OfflineRun, replay_offline
from kvobserve.simulate.trace import TraceRequest, read_trace
from kvobserve.wire.kv_events import BlockRemoved, BlockStored, KvBatch, decode_payload
from kvobserve.wire.misses import RECORD, MissDelta, decode_delta, encode_delta, iter_ops

FIXTURE = Path(__file__).parents[1] / "fixtures" / "traces" / "mooncake-conversation.jsonl.gz"
KINDS = ("compulsory", "capacity", "placement")


@cache
def _trace(seconds: float) -> tuple[TraceRequest, ...]:
    return tuple(read_trace(str(FIXTURE), seconds))


def _batch(ts: float, *events: object) -> KvBatch:
    return KvBatch("", 0, ts, 0, list(events))  # type: ignore[arg-type]


def _store(*hashes: int) -> BlockStored:
    return BlockStored(list(hashes), None, 16)


def test_each_store_is_one_kind_as_the_pool_sees_it() -> None:
    a, b = BlockIndex(), BlockIndex()
    pool = PoolMisses()
    pool.attach(0, a)
    pool.attach(1, b)
    a.apply_batch(_batch(1.0, _store(1, 2)))  # new content: compulsory
    b.apply_batch(_batch(2.0, _store(1, 3)))  # 1 is on rank 0 now: placement; 3 compulsory
    a.apply_batch(_batch(3.0, _store(1, 2)))  # resident on rank 0 already: no miss
    a.apply_batch(_batch(4.0, BlockRemoved([1, 2])))
    b.apply_batch(_batch(5.0, BlockRemoved([1])))
    a.apply_batch(_batch(6.0, _store(1, 2, 4)))  # 1, 2 evicted everywhere: capacity; 4 new
    b.apply_batch(_batch(7.0, BlockRemoved([3]), _store(3)))  # removed then stored in one batch
    assert pool.ranks[0].counts.as_dict() == {"compulsory": 3, "capacity": 2, "placement": 0}
    assert pool.ranks[1].counts.as_dict() == {"compulsory": 1, "capacity": 1, "placement": 1}
    assert pool.totals().total == 8 == sum(ix.stored_total["GPU"] for ix in (a, b))
    cpu = BlockStored([9], None, 16, medium="CPU")
    a.apply_batch(_batch(8.0, cpu))  # an offload is no miss: only the compute tier counts
    assert pool.totals().total == 8
    pool.detach(1)  # rank 1 gone from this collector: its blocks no longer count as placement
    assert b.misses is None
    a.apply_batch(_batch(9.0, _store(3)))
    assert pool.ranks[0].counts.capacity == 3


def _drive(
    reqs: tuple[TraceRequest, ...], fmt: str, route: str, on: Callable[[int, KvBatch], None],
    capacity: int = 300_000,
) -> OfflineRun:  # fmt: skip
    def cb(rank: int, seq: int, payload: bytes) -> None:
        on(rank, decode_payload("", seq, payload))

    return replay_offline(reqs, format=fmt, ranks=4, capacity_tokens=capacity, page_size=32,
                          route=route, on_batch=cb)  # fmt: skip


@pytest.mark.parametrize(
    ("fmt", "route"),
    [("sglang-0.5.23", "random"), ("vllm-0.33", "kv_aware"), ("sglang-0.4", "round_robin"),
     ("vllm-0.33-bytes", "random")],
)  # fmt: skip
def test_the_split_of_the_events_equals_the_simulators_truth(fmt: str, route: str) -> None:
    indexes = [BlockIndex() for _ in range(4)]
    pool = PoolMisses()
    for r, ix in enumerate(indexes):
        pool.attach(r, ix)
    run = _drive(_trace(60.0), fmt, route, lambda r, b: indexes[r].apply_batch(b))
    truth = run.replay.truth()
    assert truth["pool"]["unstored_pages"] == 0  # every miss was stored: misses == stores
    for r, ix in enumerate(indexes):
        want = {k: truth["ranks"][str(r)]["pages"][k] for k in KINDS}
        assert pool.ranks[r].counts.as_dict() == want
        assert ix.resident_hashes().get("GPU", set()) == set(run.streams[r].cache.nodes)
    p = truth["pool"]["pages"]
    assert p["capacity"] > 0 and p["compulsory"] > 0  # evictions happened
    if route != "kv_aware":
        assert p["placement"] > 0


def _sampled_run(
    reqs: tuple[TraceRequest, ...], route: str, floor: int, capacity: int = 300_000
) -> tuple[OfflineRun, SampledSplit, list[MissSampler], int]:
    """Ranks 0-1 and 2-3 in two collectors, each shipping a delta every `interval` engine
    seconds through the wire encoding; the aggregator's merge."""
    start = 0 if floor > 10**8 else START_LEVEL  # everything: level 0 for ever
    samplers = [MissSampler("w", True, floor=floor, start_level=start) for _ in range(2)]
    merged = SampledSplit(floor=floor, start_level=start)
    sent = [0]
    interval = 5.0
    due = [reqs[0].timestamp_ms / 1000 + interval]

    def ship(until: float) -> None:
        for c, s in enumerate(samplers):
            data = encode_delta(s.delta(until))
            sent[0] += len(data)
            merged.add(f"node-{c}", decode_delta(data))
        merged.advance()
        for s in samplers:
            s.follow(merged.level)

    def on(rank: int, batch: KvBatch) -> None:
        while batch.ts >= due[0]:
            ship(due[0])
            due[0] += interval
        samplers[rank // 2].observe(rank, batch)

    run = _drive(reqs, "sglang-0.5.23", route, on, capacity)
    ship(due[0] + 1e6)
    return run, merged, samplers, sent[0]


def test_a_sample_of_everything_merged_from_two_collectors_is_exact() -> None:
    run, merged, samplers, _ = _sampled_run(_trace(60.0), "random", floor=10**9)
    assert merged.level == 0 and all(s.level == 0 for s in samplers)
    truth = run.replay.truth()
    for r in range(4):
        got = dict(zip(KINDS, merged.sampled_misses([("w", r)]), strict=True))
        assert got == {k: truth["ranks"][str(r)]["pages"][k] for k in KINDS}
    assert merged.late_ops == 0 and not merged.lost


@pytest.mark.slow
def test_the_sampled_split_is_within_its_bound_and_stays_small() -> None:
    reqs = _trace(400.0)
    run, merged, samplers, sent = _sampled_run(reqs, "random", floor=FLOOR, capacity=2_000_000)
    p = run.replay.truth()["pool"]["pages"]
    misses = sum(p[k] for k in KINDS)
    est = merged.estimate()
    assert est.trusted and est.sampled >= FLOOR and est.level >= 4  # sampled, not everything
    assert 0 < max(s.level for s in samplers) <= merged.level  # the collectors ship no less
    assert est.bound <= 0.0155
    for k in KINDS:
        assert abs(est.shares[k] - p[k] / misses) <= est.bound, k
    assert p["placement"] / misses > 0.03  # random routing: a share worth estimating
    # the aggregator's sets stay near 2 * floor blocks, whatever the pool holds
    assert len(merged.seen) <= 2 * FLOOR
    assert sum(len(s) for s in merged.resident.values()) <= len(merged.seen)
    # the collectors ship a few records per sampled store, not one per store
    assert sent < 0.1 * misses * RECORD.size  # a tenth of one record per store, here


def test_deltas_round_trip_and_a_lost_one_is_told() -> None:
    s = MissSampler("w", signed=False, start_level=0)
    a, b = 5 << 40, 1 << 62
    s.observe(3, _batch(10.0, _store(a, b), BlockRemoved([a])))
    d = s.delta(10.5)
    back = decode_delta(encode_delta(d))
    assert back == d and len(back.ops) == 3 * RECORD.size
    ops = list(iter_ops(back))
    w3 = ("w", 3)
    assert [(o.rank, o.op, o.key) for o in ops] == [(w3, 0, a >> 16), (w3, 0, b >> 16),
                                                    (w3, 1, a >> 16)]  # fmt: skip
    assert all(abs(o.ts - 10.0) < 1e-3 for o in ops)
    merged = SampledSplit(floor=1, start_level=0)
    merged.add("a", back)
    merged.add("a", MissDelta("w", 3, 0, 11.0, 11.0))  # seq 2 never came
    merged.advance()
    est = merged.estimate()
    assert not est.trusted and "1 deltas lost" in est.reason
    assert est.shares["compulsory"] == 1.0


SPREAD = 0x9E3779B97F4A7C15  # hashes spread over the key space, as the engines' are


def test_a_full_delta_resyncs_what_a_rank_holds() -> None:
    h11, h12, h13 = ((i * SPREAD) % (1 << 64) - (1 << 63) for i in (11, 12, 13))
    s = MissSampler("w", signed=True, start_level=0)
    merged = SampledSplit(floor=10**9, start_level=0)
    s.observe(0, _batch(1.0, _store(h11, h12)))
    merged.add("a", s.delta(1.5))
    s.delta(2.0)  # lost on the way: rank 0 dropped h11 and stored h13 meanwhile
    merged.add("a", s.full({0: [h12, h13]}, 2.5))
    merged.advance()
    assert merged.lost == {"a": 1}
    assert merged.resident[("w", 0)] == {s.key(h12) >> 16, s.key(h13) >> 16}
    other = MissSampler(
        "w", signed=True, start_level=0
    )  # another collector's rank stores h13: placement
    other.observe(1, _batch(3.0, _store(h13)))
    merged.add("b", other.delta(3.5))
    merged.add("a", s.delta(3.5))
    merged.advance()
    assert merged.sampled_misses([("w", 1)]) == [0, 0, 1]


def test_raising_the_level_keeps_a_uniform_sample() -> None:
    s = MissSampler("w", signed=False, floor=2, start_level=0)
    keys = [1 << 63, 1 << 62, 1 << 61, 1 << 60, 1 << 59, 1 << 58]  # buckets 0 .. 5
    s.observe(0, _batch(1.0, _store(*keys)))
    assert s.level == 2  # 6 sampled stores > 2 * floor = 4: 5 at level 1, 4 at level 2
    assert s._sampled([1 << 63, 1 << 61]) == [1 << 61]  # bucket 0 is out, bucket 2 in
    merged = SampledSplit(floor=1, start_level=0)
    merged.add("a", s.delta(1.5))
    merged.advance()
    # 4 misses in buckets >= 2 (> 2 * floor): raised to 3, then 3 left, to 4, 2 left
    assert merged.level == 4 and merged.sampled_misses() == [2, 0, 0]
    assert all(ident_bucket(i) >= 4 for i in merged.seen) and len(merged.seen) == 2


def test_a_block_that_misses_again_and_again_widens_the_bound() -> None:
    """Its misses come into the sample together: the bound is the clusters', not binomial."""
    blocks = [(i * SPREAD) % (1 << 64) for i in range(1, 101)]
    hot = (777 * SPREAD) % (1 << 64)

    def run(repeats: int) -> tuple[float, float]:
        a = MissSampler("w", signed=False, start_level=0)
        b = MissSampler("w", signed=False, start_level=0)
        merged = SampledSplit(floor=10**6, start_level=0)  # every block stays in the sample
        a.observe(0, _batch(1.0, _store(hot, *blocks)))  # 101 compulsory on rank 0
        for t in range(repeats):  # rank 1 recomputes what rank 0 holds: placement
            b.observe(1, _batch(2.0 + t, _store(hot), BlockRemoved([hot])))
        for k, s in enumerate((a, b)):
            merged.add(f"n{k}", s.delta(1e9))
        merged.advance()
        est = merged.estimate()
        p = est.shares["placement"]
        return est.bound, BOUND_Z * (p * (1 - p) / est.sampled) ** 0.5

    spread, binomial = run(100)
    assert spread > 2 * binomial  # one block carries half the misses
    spread, binomial = run(1)
    assert spread == pytest.approx(binomial, rel=0.25)  # no cluster to speak of
