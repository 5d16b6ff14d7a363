"""Cache analytics rules: trust state, silent-loss evidence, restores, hot prefixes, sketches."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvobserve.analysis.actions import RequestReplay
from kvobserve.analysis.analytics import AnalyticsOptions, CacheAnalytics
from kvobserve.analysis.blocks import BlockIndex
from kvobserve.analysis.hot import HotBlocks, merge_top
from kvobserve.analysis.placement import local_placement, merge_placement
from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.analysis.thrash import RecentRemovals
from kvobserve.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvBatch
from tests.examples import examples


def _stored(hashes: list[int], parent: int | None = None, medium: str = "GPU") -> BlockStored:
    return BlockStored(hashes, parent, block_size=16, medium=medium)


def _removed(hashes: list[int], medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved(hashes, medium)


def _batch(seq: int, *events: object, ts: float | None = None) -> KvBatch:
    return KvBatch("", seq, 1000.0 + seq if ts is None else ts, 0, list(events))  # type: ignore[arg-type]


def _seq(**kw: object) -> StreamSequencer:
    idx = BlockIndex()
    sq = StreamSequencer(0, index=idx, **kw)  # type: ignore[arg-type]
    idx.analytics = CacheAnalytics(AnalyticsOptions(), sq.trust)
    return sq


# --- trust state ---------------------------------------------------------------------------------


def test_trust_from_the_start_and_after_a_gap_without_replay() -> None:
    sq = _seq(replay=False)
    assert (sq.trust.state, sq.trust.reason, sq.state_complete) == ("partial", "waiting", False)
    sq.on_batch(_batch(0, _stored([1])), b"0", 0.0)
    assert (sq.trust.state, sq.trust.reason, sq.state_complete) == ("complete", "from_start", True)
    sq.on_batch(_batch(3, _stored([2])), b"3", 0.1)
    assert (sq.trust.state, sq.trust.reason, sq.state_complete) == (
        "partial",
        "lost_batches",
        False,
    )
    sq.on_batch(_batch(4, AllBlocksCleared()), b"4", 0.2)
    assert (sq.trust.state, sq.trust.reason) == ("complete", "cleared")


def test_trust_joined_midstream_and_whole_replays() -> None:
    sq = _seq(replay=False)
    sq.on_batch(_batch(7, _stored([1])), b"7", 0.0)
    assert (sq.trust.state, sq.trust.reason) == ("partial", "joined_midstream")
    sq = _seq(replay=True)
    ask = sq.on_batch(_batch(2, _stored([3], 2)), b"2", 0.0)
    assert isinstance(ask, RequestReplay) and ask.start_seq == 0
    sq.on_replay_batch(ask.replay_id, _batch(0, _stored([1])))
    sq.on_replay_batch(ask.replay_id, _batch(1, _stored([2], 1)))
    sq.on_replay_end(ask.replay_id, "ok")
    assert (sq.trust.state, sq.trust.reason) == ("complete", "replayed_from_start")
    ask = sq.on_batch(_batch(4, _stored([5], 4)), b"4", 0.1)  # 3 is missing: a gap
    assert isinstance(ask, RequestReplay) and ask.start_seq == 3
    sq.on_replay_batch(ask.replay_id, _batch(3, _stored([4], 3)))
    sq.on_replay_end(ask.replay_id, "ok")
    assert (sq.trust.state, sq.trust.reason, sq.state_complete) == (
        "replay_filled", "gap_replayed", True,
    )  # fmt: skip
    assert sq.index.analytics is not None
    assert sq.index.analytics.silent_loss == {"remove_unknown": 0, "parent_unknown": 0}


def test_a_replay_that_cannot_reach_seq_0_leaves_the_view_partial() -> None:
    sq = _seq(replay=True)
    ask = sq.on_batch(_batch(5, _stored([9])), b"5", 0.0)
    assert isinstance(ask, RequestReplay)
    sq.on_replay_batch(ask.replay_id, _batch(3, _stored([7])))  # the ring starts at 3
    sq.on_replay_batch(ask.replay_id, _batch(4, _stored([8], 7)))
    sq.on_replay_end(ask.replay_id, "ok")
    assert (sq.trust.state, sq.trust.reason) == ("partial", "joined_midstream")


# --- silent loss -----------------------------------------------------------------------------------


def test_unknown_removals_and_orphan_stores_count_only_while_trusted() -> None:
    sq = _seq(replay=False)
    a = sq.index.analytics
    assert a is not None
    sq.on_batch(_batch(0, _stored([1, 2]), _stored([3], 2)), b"0", 0.0)
    sq.on_batch(_batch(1, _removed([99]), _stored([5], 77)), b"1", 0.0)  # never stored, no parent
    assert a.silent_loss == {"remove_unknown": 1, "parent_unknown": 1}
    sq.on_batch(_batch(2, _removed([3]), _removed([3])), b"2", 0.0)  # a duplicate copy: explained
    sq.on_batch(_batch(3, _stored([6], 3)), b"3", 0.0)  # its parent was just evicted: explained
    sq.on_batch(_batch(4, _stored([8], 5740354900026072187)), b"4", 0.0)  # SGLang 0.4's root
    sq.on_batch(_batch(5, _stored([9, 10], None, "CPU")), b"5", 0.0)  # lower tier: no rule
    assert a.silent_loss == {"remove_unknown": 1, "parent_unknown": 1}
    sq.on_batch(_batch(9, _removed([1234])), b"9", 0.0)  # a gap: partial, nothing is evidence
    sq.on_batch(_batch(10, _stored([11], 4321)), b"10", 0.0)
    assert sq.trust.state == "partial"
    assert a.silent_loss == {"remove_unknown": 1, "parent_unknown": 1}


# --- restores ------------------------------------------------------------------------------------


def test_restores_within_the_window_with_their_gaps() -> None:
    rec = RecentRemovals(window_s=10.0, cap=100)
    rec.add([1, 2, 3], 100.0)
    assert rec.restore([1, 2, 9], 104.0) == 1
    assert (rec.restored, rec.gaps.count, rec.gaps.sum) == (2, 2, 8.0)
    assert rec.restore([3], 111.0) is None  # 11 s later: outside the window
    assert rec.restored == 2


def test_the_cap_refuses_and_counts_and_expiry_makes_room() -> None:
    rec = RecentRemovals(window_s=10.0, cap=4)
    rec.add([1, 2, 3], 100.0)
    rec.add([4, 5, 6], 101.0)  # one fits
    assert (len(rec.removed), rec.refused) == (4, 2)
    rec.add([7], 105.0)  # nothing old enough to expire yet
    assert rec.refused == 3
    rec.add([8, 9], 110.5)  # the removals at 100 expired
    assert set(rec.removed) == {4, 8, 9} and rec.refused == 3


def test_a_thrashing_rank_counts_restores_per_medium() -> None:
    idx = BlockIndex()
    idx.analytics = a = CacheAnalytics(AnalyticsOptions(restore_window_s=60.0))
    idx.apply_batch(_batch(0, _stored([1, 2, 3]), ts=0.0))
    idx.apply_batch(_batch(1, _removed([2, 3]), ts=5.0))
    idx.apply_batch(_batch(2, _stored([2, 3], 1), ts=6.5))
    idx.apply_batch(_batch(3, _removed([3]), ts=100.0))
    idx.apply_batch(_batch(4, _stored([3], 2), ts=200.0))  # 100 s later: not thrash
    assert a.restored() == {"GPU": 2}
    assert a.recent["GPU"].gaps.sum == 3.0
    assert a.hot.top() == [(2, 1)]  # the recomputation began at block 2


# --- hot prefixes --------------------------------------------------------------------------------


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.integers(0, 40), max_size=600), st.integers(2, 16))
def test_hot_counts_are_lower_bounds_within_the_offset(keys: list[int], cap: int) -> None:
    hot = HotBlocks(cap)
    for k in keys:
        hot.add(k)
    assert len(hot.counts) <= cap
    for k, n in hot.counts.items():
        true = keys.count(k)
        assert n <= true <= n + hot.offset
    for k in set(keys) - set(hot.counts):
        assert keys.count(k) <= hot.offset


def test_merged_tops_sum_counts_and_offsets() -> None:
    top, bound = merge_top([([(1, 5, 1), (2, 3, 1)], 2, "a"), ([(1, 4, 0), (3, 9, 1)], 1, "b")], 2)
    assert top == [(1, 9, 1), (3, 9, 1)] and bound == 3


def test_merged_holders_count_each_collectors_ranks_once() -> None:
    # two ranks of collector a both hold hash 1 (each stream reports 2 holders), one rank of b
    lists = [([(1, 3, 2)], 0, "a"), ([(1, 4, 2)], 0, "a"), ([(1, 1, 1)], 0, "b")]
    assert merge_top(lists, 1) == ([(1, 8, 3)], 0)


# --- placement sketch ----------------------------------------------------------------------------

K = 256
SEEDS = range(20)


def _ranks(seed: int, n: int, overlap: float, signed: bool) -> list[set[int]]:
    rng = random.Random(seed)
    shared = {rng.getrandbits(64) for _ in range(int(n * overlap))}
    out = []
    for _ in range(4):
        own = {rng.getrandbits(64) for _ in range(n - len(shared))}
        out.append(
            {h - (1 << 63) if signed else h for h in shared | own} if rng.random() < 2 else set()
        )
    return out


@pytest.mark.parametrize("signed", [False, True])
def test_merged_sketches_estimate_distinct_blocks_within_the_documented_bound(signed: bool) -> None:
    errors = []
    for seed in SEEDS:
        ranks = _ranks(seed, 5000, 0.3, signed)
        # ranks 0-1 on one collector, 2-3 on another
        parts = [
            local_placement("w", {r: dict.fromkeys(ranks[r], 0.0) for r in rs}, k=K,
                            signed=signed, sketch=True)
            for rs in ((0, 1), (2, 3))
        ]  # fmt: skip
        est = merge_placement(parts)
        union = set().union(*ranks)
        truth4 = sum(1 for h in union if sum(h in s for s in ranks) == 4)
        assert not est.exact and est.blocks_sum == sum(len(s) for s in ranks)
        errors.append(est.blocks_distinct / len(union) - 1)
        # the share of blocks on all 4 ranks is a binomial share of the k sampled blocks
        share = truth4 / len(union)
        sigma = ((1 - share) / (K * share)) ** 0.5 + 1 / (K - 2) ** 0.5
        assert abs(est.replicated.get(4, 0) / truth4 - 1) <= 3 * sigma
    bound = 1 / (K - 2) ** 0.5
    assert max(abs(e) for e in errors) <= 3 * bound  # docs/cache-analytics.md: within 3 RSE
    assert (sum(e * e for e in errors) / len(errors)) ** 0.5 <= 1.5 * bound


def test_small_sets_merge_exactly() -> None:
    a = {1: 0.0, 2: 0.0, 3: 0.0}
    b = {3: 0.0, 4: 0.0}
    parts = [
        local_placement("w", {0: a}, k=16, signed=False, sketch=True),
        local_placement("w", {1: b}, k=16, signed=False, sketch=True),
    ]
    est = merge_placement(parts)
    assert est.exact and est.blocks_distinct == 4 and est.replicated == {2: 1.0}
    assert est.redundancy == 5 / 4


# --- over capacity (aggregator) ------------------------------------------------------------------


def test_resident_tokens_above_capacity_are_flagged_where_the_capacity_is_known() -> None:
    from kvobserve.analysis.fleet import FleetState
    from kvobserve.export.api import streams_json
    from kvobserve.wire.snapshot import (
        CollectorInfo,
        MediumStats,
        Snapshot,
        StreamStats,
        WorkerInfo,
    )

    def snap(gpu_tokens: int, seq: int) -> Snapshot:
        return Snapshot(
            CollectorInfo("c", start_time=1.0),
            seq=seq,
            time=100.0,
            workers=[WorkerInfo("w", dp_size=2, ranks_owned=[0, 1], capacity_tokens=1000)],
            streams=[
                StreamStats("w", 0, up=True, media=[MediumStats("GPU", tokens=gpu_tokens),
                                                    MediumStats("CPU", tokens=5000)]),
                StreamStats("w", 1, up=True, media=[MediumStats("GPU", tokens=1000)]),
            ],
        )  # fmt: skip

    fs = FleetState()
    fs.update(snap(1001, 1), 100.0)
    v = fs.view(100.0)
    assert [s.over_capacity for s in v.streams] == [True, False]  # at capacity is fine
    assert [s["over_capacity"] for s in streams_json(v)] == [True, False]
    fs.update(snap(999, 2), 100.0)
    assert [s.over_capacity for s in fs.view(100.0).streams] == [False, False]
