"""What more memory would buy, judged by the simulator: the conversation trace on one rank.

The live path without sockets (benchmarks/capacity.py `drive`): the simulator's batches through
the rank's sequencer, its pool's miss sampler and its capacity curve, a snapshot every 50
batches into a FleetState, the aggregator's curve at the end; against replays of the same
requests through one cache of each capacity (simulate/replay.py `replay_capacities`), in the
engine's pages (512 tokens: one per trace block, as the trace's own facts count them).

The points above C are judged on the trace's first 3,000 requests (15 minutes, 80,619
lookups): the estimator reads each re-stored block's depth in the ghost list, which does not
depend on how long the trace runs once (m - 1) x C of evictions were seen, and the whole trace
would make each test minutes long. The unlimited point needs the whole trace (the trace's
36.64 % is over all of it): one run, both samplings.
"""

from __future__ import annotations

import math

import pytest

from benchmarks.capacity import FIXTURE, drive
from kvobserve.analysis.capacity import BELOW, FACTORS, CurveOptions
from kvobserve.simulate.replay import replay_capacities
from kvobserve.simulate.trace import read_trace

PAGE = 512
SLICE = 3000
EVERY = CurveOptions(level=0, interval_s=1e-9)  # every block tracked
DEFAULT = CurveOptions(interval_s=1e-9)  # the default sample (1/16 of the blocks)
# the slice's unlimited hit rate is 31.42 %: at these capacities (blocks) a rank hits about
# half of it and about three quarters
HALF, THREE_QUARTERS = 6800, 12500


@pytest.fixture(scope="module")
def requests() -> list:  # type: ignore[type-arg]
    return read_trace(str(FIXTURE))


def _truth(reqs: list, capacity: int, factors: tuple[float, ...]) -> dict[float, float]:  # type: ignore[type-arg]
    got = replay_capacities(reqs, [int(m * capacity) for m in factors], page_size=PAGE)
    return {
        m: got[int(m * capacity)].pages.hits / got[int(m * capacity)].pages.lookups for m in factors
    }


@pytest.mark.parametrize(("blocks", "share"), [(HALF, 0.5), (THREE_QUARTERS, 0.75)])
def test_the_curve_above_c_equals_replays_at_each_capacity(
    requests: list,  # type: ignore[type-arg]
    blocks: int,
    share: float,
) -> None:
    reqs = requests[:SLICE]
    cap = blocks * PAGE
    truth = _truth(reqs, cap, (1.0, *FACTORS, 1000.0))
    assert truth[1.0] / truth[1000.0] == pytest.approx(share, abs=0.03)  # the C asked for
    d = drive(reqs, capacity_tokens=cap, configs=((EVERY, False), (DEFAULT, False)))
    for i, within in ((0, 0.005), (1, 0.015)):
        worker = d.capacity(i).workers[0]
        rank = d.capacity(i).ranks[0]
        assert worker.routing == "observed" and worker.available
        assert rank.reason.startswith("no hit counter of this rank")  # SGLang counts per worker
        got = {p.factor: p for p in worker.points}
        assert got[1.0].hit_rate == pytest.approx(truth[1.0], abs=0.001)  # the engine's counter
        for m in FACTORS:
            assert got[m].hit_rate == pytest.approx(truth[m], abs=within), (i, m)
        # validity: 8 x C rests on 7 x C of evictions, which the three-quarters run lacks
        evicted = worker.estimate.ranks[0].stores - blocks  # every block stored, less C
        for m in FACTORS:
            assert got[m].trusted == (evicted >= (m - 1) * blocks), (i, m, evicted)
    assert not d.capacity(0).workers[0].point(8.0).trusted if share == 0.75 else True


def test_below_c_is_an_estimate_with_its_band(requests: list) -> None:  # type: ignore[type-arg]
    reqs = requests[:SLICE]
    cap = HALF * PAGE
    truth = _truth(reqs, cap, BELOW)
    d = drive(reqs, capacity_tokens=cap, configs=((EVERY, True), (DEFAULT, True)))
    for i in range(2):
        worker = d.capacity(i).workers[0]  # one rank: its hits are the worker's (SGLang)
        est = worker.estimate
        hits = est.hits
        assert est.walked > 0.9 * hits  # store-less hits under 10 %
        for m in BELOW:
            p = worker.point(m)
            assert p is not None and p.trusted
            assert p.low <= p.hit_rate <= p.high
            assert p.hit_rate == pytest.approx(truth[m], abs=0.015), (i, m)
            assert p.high - p.low == pytest.approx((hits - est.walked) / worker.lookups, abs=0.01)


def test_the_unlimited_point_is_the_traces_own_once_all_of_it_was_seen(
    requests: list,  # type: ignore[type-arg]
) -> None:
    d = drive(requests, capacity_tokens=8295 * PAGE, configs=((EVERY, False), (DEFAULT, False)),
              every=200)  # fmt: skip
    for i in range(2):
        worker = d.capacity(i).workers[0]
        unlimited = worker.point(math.inf)
        assert unlimited is not None and unlimited.trusted
        assert unlimited.hit_rate == pytest.approx(0.3664, abs=0.005), i
        assert "since observed" in unlimited.rests_on
        # the pool as one cache of one rank's memory is the rank itself: the same curve
        pool = d.capacity(i).pool
        assert pool.point(math.inf).hit_rate == pytest.approx(0.3664, abs=0.005)


@pytest.mark.parametrize("route", ["random", "kv_aware"])
def test_a_pools_global_curve_equals_one_cache_of_its_total_memory(
    requests: list,  # type: ignore[type-arg]
    route: str,
) -> None:
    """Four ranks over two collectors, the default sample: the pool as one cache of m x its
    four ranks' memory against a replay of one cache that large; per-rank curves say they
    hold for the routing that was observed."""
    reqs = requests[:SLICE]
    rank = 1700 * PAGE
    truth = _truth(reqs, 4 * rank, (1.0, 2.0, 4.0))
    d = drive(reqs, capacity_tokens=rank, ranks=4, collectors=2, route=route,
              configs=((DEFAULT, False),))  # fmt: skip
    pc = d.capacity()
    assert pc.pool.routing == "global" and pc.pool.capacity_tokens == 4 * rank
    for m in (1.0, 2.0, 4.0):
        p = pc.pool.point(m)
        assert p is not None and p.hit_rate == pytest.approx(truth[m], abs=0.01), (route, m)
    assert [r.routing for r in pc.ranks] == ["observed"] * 4
    assert pc.workers[0].routing == "observed"
