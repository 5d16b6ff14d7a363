"""The capacity curve's rules: depths, validity, trust, what is not available and why, the API,
the page, the settings (docs/cache-analytics.md "What more memory would buy")."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvobserve.analysis.capacity import BINS, CurveOptions, RankCurve, RankDeltas, bin_of, upto
from kvobserve.analysis.capacity_pool import PoolDeltas, depth_bin, within
from kvobserve.analysis.fleet import FleetState
from kvobserve.analysis.miss_fleet import MissMerge
from kvobserve.analysis.sequence import StreamSequencer
from kvobserve.config.load import load_config
from kvobserve.config.model import ConfigError
from kvobserve.export import api, status_page
from kvobserve.simulate.config import SimConfig
from kvobserve.sources.capacity_stats import RankCurves, WorkerCurve
from kvobserve.wire.capacity import RankCurveStats
from kvobserve.wire.misses import REMOVE, STORE, MissDelta, pack_op
from kvobserve.wire.snapshot import (
    CollectorInfo,
    MediumStats,
    PrefixCounters,
    Snapshot,
    StreamStats,
    WorkerInfo,
)

NOW = 5000.0


# --- a rank's ghost list ------------------------------------------------------------------------


def test_a_restored_block_counts_at_the_depth_of_what_was_evicted_after_it() -> None:
    c = RankCurve(CurveOptions(level=0), capacity_tokens=100)
    c.stored(list(range(1, 11)), 10, 10, None, list(range(1, 11)))  # ten blocks of 10 tokens
    c.removed([1, 2, 3, 4, 5], [1, 2, 3, 4, 5])  # evicted oldest first
    c.stored([3], 1, 10, None, [3])
    # 4 and 5 (20 tokens) were evicted after it, and it takes 10 itself: 0.3 x the capacity
    assert c.restores[bin_of(0.3)] == 1 and sum(c.restores) == 1
    assert (c.stores, c.sampled_stores, c.evicted, c.stats("w", 0).evicted_tokens) == (
        11,
        11,
        5,
        50,
    )
    c.stored([1], 1, 10, None, [1])  # 2, 4, 5 after it (3 came back): 0.4
    assert c.restores[bin_of(0.4)] == 1


def test_a_clear_empties_the_ghost_list_and_starts_the_evictions_again() -> None:
    c = RankCurve(CurveOptions(level=0), capacity_tokens=100)
    c.stored([1, 2], 2, 10, None, [1, 2])
    c.removed([1, 2], [1, 2])
    c.cleared()
    assert (c.evicted, c.resets, len(c.ghosts)) == (0, 1, 0)
    c.stored([1], 1, 10, None, [1])  # an unlimited cache was emptied too: no hit anywhere
    assert sum(c.restores) == 0 and c.beyond == 0


def test_blocks_past_the_horizon_count_for_unlimited_memory_only() -> None:
    c = RankCurve(CurveOptions(level=0, horizon=2.0), capacity_tokens=20)  # ghosts: 1 x 20
    c.stored([1, 2, 3, 4, 5], 5, 10, None, [1, 2, 3, 4, 5])
    c.removed([1, 2, 3, 4, 5], [1, 2, 3, 4, 5])  # 50 tokens of ghosts: 1..3 leave the horizon
    c.stored([1], 1, 10, None, [1])
    assert sum(c.restores) == 0 and c.beyond == 1.0
    d = RankDeltas(6, 6, tuple(c.restores), c.beyond, 20, 20, hits=0.0)
    assert d.at(2.0) == 0 and d.at(math.inf) == pytest.approx(1 / 6)


def test_the_sample_scales_depths_and_the_exact_stores() -> None:
    # 1 in 2^level blocks followed: a sampled ghost stands for 2^level tokens-worth of blocks
    d = RankDeltas(stores=1600, sampled=100, restores=tuple([0] * BINS), beyond=0.0,
                   basis=1000, capacity=1000, hits=400.0)  # fmt: skip
    assert d.at(2.0) == pytest.approx(400 / 2000)
    r = [0] * BINS
    r[bin_of(0.4)] = 10  # 10 % of the sampled stores were re-stores at about 0.4 x C
    d = RankDeltas(1600, 100, tuple(r), 0.0, 1000, 1000, hits=400.0)
    assert d.at(1.25) == pytest.approx(400 / 2000)  # not yet
    assert d.at(2.0) == pytest.approx((400 + 160) / 2000)  # 160 of the 1,600 stores
    # a basis other than the capacity (the most the rank held): the bins are read in it
    d = RankDeltas(1600, 100, tuple(r), 0.0, 500, 1000, hits=400.0)
    assert d.at(1.25) == pytest.approx((400 + 160) / 2000)  # 0.25 x 1000 = 0.5 x 500


def test_bins_read_partially_in_log_width() -> None:
    r = [0] * BINS
    r[bin_of(1.0)] = 8
    low = 2.0 ** ((bin_of(1.0) - 1) / 8 - 5)
    high = low * 2 ** (1 / 8)
    assert upto(r, low) == 0 and upto(r, high) == 8
    assert upto(r, math.sqrt(low * high)) == pytest.approx(4)
    assert upto(r, math.inf) == 8


def test_the_pool_as_one_cache_adds_placement_and_what_fits() -> None:
    depths = {depth_bin(100): 10.0, depth_bin(1000): 30.0}
    d = PoolDeltas(hits=100, compulsory=50, capacity=40, placement=10, depths=depths, blocks=200)
    assert within(depths, 150) == 10 and within(depths, 2000) == 40
    assert d.at(1.0) == pytest.approx((100 + 10 + 10) / 200)  # 200 blocks hold the first
    assert d.at(math.inf) == pytest.approx((100 + 10 + 40) / 200)
    scaled = PoolDeltas(100, 50, 40, 10, depths, 200, stores=50)  # sampled misses: 100 -> 50
    assert scaled.at(1.0) == pytest.approx((100 + 0.5 * 20) / 150)


# --- the collector: which ranks get a curve -----------------------------------------------------


def test_only_engines_that_evict_by_recency_get_a_curve() -> None:
    curves = RankCurves(CurveOptions(), {"w": WorkerCurve(4096, below=True)})
    seq = StreamSequencer(0, replay=False)
    assert curves.make("w", 0, "dynamo", seq) is None  # its profile: not declared
    c = curves.make("w", 1, "vllm", seq)
    assert c is not None and c.capacity == 4096 and c.below is not None
    pod = curves.make("w/pod-a", 0, "sglang", seq)  # a pod of the worker: its settings
    assert pod is not None and pod.capacity == 4096 and pod.signed
    assert [(s.worker_id, s.dp_rank) for s in curves.stats(0.0)] == [("w", 1), ("w/pod-a", 0)]
    assert curves.stats(5.0) == []  # within the interval: nothing new


# --- the aggregator: trust, validity, what is not available ---------------------------------------


def _curve(worker: str, rank: int, n: int, evicted_tokens: int) -> RankCurveStats:
    restores = [0] * BINS
    restores[bin_of(0.5)] = n // 10
    return RankCurveStats(worker, rank, 0, 1000, True, n, n, restores,
                          evicted_tokens=evicted_tokens, block_size=10)  # fmt: skip


def _snap(
    cid: str, seq: int, t: float, workers: list[tuple[str, str, str]], n: int = 0,
    evicted_tokens: int = 0, trust: str = "complete", onboarded: int = 0, tier_tokens: int = 0,
) -> Snapshot:  # fmt: skip
    """One collector watching rank 0 of each (worker, engine, pool): `n` blocks stored by then
    (a tenth of them restores at 0.5 x C), as many hit, its deltas into the pool."""
    infos, streams, misses, prefix, curves = [], [], [], [], []
    for i, (w, engine, pool) in enumerate(workers):
        infos.append(WorkerInfo(w, engine, 1, [0], True, 1000, tier_tokens=tier_tokens))
        gpu = MediumStats("GPU", 100, 1000, moved_in={"CPU_PINNED": onboarded} if onboarded else {})
        streams.append(StreamStats(w, 0, engine=engine, up=True, trust=trust, block_size=10,
                                   media=[gpu]))  # fmt: skip
        ops = bytearray()
        for k in range(n // 2 if seq > 1 else 0):
            pack_op(ops, 0, 0, STORE, (k + 1 + 1000 * i) << 16)
            pack_op(ops, 1, 0, REMOVE, (k + 1 + 1000 * i) << 16)
        misses.append(MissDelta(pool, seq, 0, t - 2, t - 1, [0], bytes(ops),
                                workers=[w] if w != pool else []))  # fmt: skip
        prefix.append(PrefixCounters(w, 0, 10.0 * n, 20.0 * n))
        curves.append(_curve(w, 0, n, evicted_tokens))
    return Snapshot(CollectorInfo(cid, 0, cid, 1.0), seq=seq, time=t, workers=infos,
                    streams=streams, misses=misses, prefix=prefix, curves=curves)  # fmt: skip


def _view(*snaps: Snapshot) -> FleetState:
    state = FleetState()
    state.misses = MissMerge(floor=1, start_level=0)
    for s in snaps:
        state.update(s, s.time)
    return state


def test_each_point_rests_on_the_evictions_seen_since_the_start() -> None:
    state = _view(
        _snap("a", 1, NOW - 10, [("w", "vllm", "w")]),
        _snap("a", 2, NOW, [("w", "vllm", "w")], n=4000, evicted_tokens=1500),
    )
    pc = state.view(NOW).capacity["w"]
    rank = pc.ranks[0]
    assert rank.trusted and rank.routing == "observed"
    got = {p.factor: p for p in rank.points}
    # 1.5 x C evicted since the start: up to 2 x C (1 x C of ghosts) it stands, 4 x not yet
    assert [m for m, p in got.items() if p.trusted] == [1.0, 1.25, 1.5, 2.0, math.inf]
    assert "1.50 x C evicted" in got[4.0].rests_on and "needs 3" in got[4.0].rests_on
    assert got[1.0].hit_rate == pytest.approx(4000 / 8000)  # the counter: 400 of 800 blocks
    assert got[2.0].hit_rate == pytest.approx((4000 + 400) / 8000)  # the restores at 0.5 x C
    assert got[1.25].hit_rate == pytest.approx(0.5)
    assert got[2.0].capacity_tokens == 2000 and got[2.0].capacity_bytes is None


def test_a_partial_rank_or_few_lookups_are_told() -> None:
    state = _view(
        _snap("a", 1, NOW - 10, [("w", "vllm", "w")], trust="partial"),
        _snap("a", 2, NOW, [("w", "vllm", "w")], n=400, evicted_tokens=9000, trust="partial"),
    )
    rank = state.view(NOW).capacity["w"].ranks[0]
    assert not rank.trusted and rank.reasons == ("rank_partial", "few_lookups")
    assert not any(p.trusted for p in rank.points)
    assert "800 lookups since observed" in rank.reason


def test_an_engine_that_does_not_evict_by_recency_says_why_instead_of_a_number() -> None:
    state = _view(_snap("a", 1, NOW, [("dyn", "dynamo", "dyn")]))
    pc = state.view(NOW).capacity["dyn"]
    assert not pc.pool.available and pc.pool.points == ()
    assert "Dynamo" in pc.pool.reason and "recency" in pc.pool.reason


def test_a_pool_that_mixes_engines_says_why_instead_of_a_number() -> None:
    state = _view(
        _snap("a", 1, NOW, [("sg", "sglang", "p")]), _snap("b", 1, NOW, [("vl", "vllm", "p")])
    )
    pc = state.view(NOW).capacity["p"]
    assert not pc.pool.available
    assert "mixes engines (sglang: sg; vllm: vl)" in pc.pool.reason


def test_the_api_and_the_page_show_every_point_and_a_tier_asked_about() -> None:
    state = _view(
        _snap("a", 1, NOW - 10, [("w", "vllm", "w")]),
        _snap("a", 2, NOW, [("w", "vllm", "w")], n=4000, evicted_tokens=9000),
        _snap("b", 1, NOW, [("dyn<x>", "dynamo", "dyn<x>")]),
    )
    v = state.view(NOW)
    doc = api.capacity_json(v, tier_tokens=1000)
    w = next(p for p in doc["pools"] if p["pool"] == "w")
    assert [p["factor"] for p in w["points"]] == ["1", "1.25", "1.5", "2", "4", "8", "+Inf"]
    worker = w["workers"][0]
    assert worker["routing"] == "observed" and w["routing"] == "global"
    # a tier of one capacity on the rank: the worker's curve at 2 x, less its measured point
    assert worker["whatif_tier"] == {"tokens": 1000, "factor": 2.0, "hit_rate": 0.55,
                                     "adds": 0.05}  # fmt: skip
    assert api.capacity_json(v, pool="w", tier_tokens=1000)["pools"] == [w]
    page = status_page.render(api.fleet_json(v), api.streams_json(v), api.alerts_json(v),
                              generated=NOW, refresh_s=5, capacity=doc)  # fmt: skip
    table = page[page.index('id="capacity"') :]
    assert "dyn&lt;x&gt;" in table and "not available" in table
    assert ">55.0%<" in table  # the worker at 2 x


@pytest.mark.parametrize(
    ("query", "said"),
    [({"tier_tokens": "lots"}, "tier_tokens: 'lots' is not a whole number"),
     ({"tier_tokens": "0"}, "tier_tokens: '0' must be a positive number"),
     ({"tier_tokens": "-3"}, "tier_tokens: '-3' must be a positive number")],
)  # fmt: skip
def test_a_bad_tier_size_in_the_query_is_named(query: dict[str, str], said: str) -> None:
    with pytest.raises(api.QueryError, match=said):
        api.capacity_query(query)


@pytest.mark.parametrize(
    ("line", "said"),
    [("tier_tokens = 0", "worker[0].tier_tokens: must be > 0, got 0"),
     ("tier_tokens = -1", "worker[0].tier_tokens: must be > 0, got -1"),
     ('kv_bytes_per_token = "big"', "worker[0].kv_bytes_per_token: expected int, got 'big'"),
     ("kv_bytes_per_token = 0", "worker[0].kv_bytes_per_token: must be > 0, got 0"),
     ("capacity_tokens = -5", "worker[0].capacity_tokens: must be >= 0, got -5")],
)  # fmt: skip
def test_a_capacity_or_tier_size_that_is_not_positive_names_the_key(
    tmp_path: Path, line: str, said: str
) -> None:
    path = tmp_path / "k.toml"
    path.write_text(f'[[worker]]\nengine = "vllm"\nkv_endpoint = "tcp://127.0.0.1:5557"\n{line}\n')
    with pytest.raises(ConfigError, match=said.replace("[", r"\[").replace("]", r"\]")):
        load_config(str(path), {}, {})


def test_a_lower_tier_says_what_it_adds_and_a_tier_asked_about_what_it_would() -> None:
    state = _view(
        _snap("a", 1, NOW - 10, [("w", "vllm", "w")], onboarded=50, tier_tokens=1000),
        _snap(
            "a",
            2,
            NOW,
            [("w", "vllm", "w")],
            n=4000,
            evicted_tokens=9000,
            onboarded=450,
            tier_tokens=1000,
        ),
    )
    t = state.view(NOW).capacity["w"].workers[0].tier
    assert t is not None and t.medium == "CPU_PINNED"
    assert t.onboarded == 400  # loaded back since observed
    assert t.adds == pytest.approx(400 / 8000)  # of the 8,000 blocks looked up
    assert t.hierarchy == pytest.approx((4000 + 400) / 8000)
    # a tier of one capacity more: the curve at 2 x, less the measured point
    assert (t.whatif_tokens, t.whatif_adds) == (1000, pytest.approx(0.05))


@pytest.mark.parametrize(
    ("kw", "said"),
    [({"truth_capacities": (1.0, 0.0), "trace": "t.jsonl"}, "truth_capacities: 0.0 must be"),
     ({"truth_capacities": (2.0,)}, "truth_capacities: needs a trace")],
)  # fmt: skip
def test_the_simulators_one_cache_truths_need_a_trace_and_positive_factors(
    kw: dict[str, object], said: str
) -> None:
    with pytest.raises(ValueError, match=said):
        SimConfig(**kw).validate()  # type: ignore[arg-type]
