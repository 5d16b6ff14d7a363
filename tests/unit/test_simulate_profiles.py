"""Named fault profiles: valid for a 2-rank worker, selectable by flag, and repeating periodically."""

from __future__ import annotations

import argparse

import pytest

from kvobserve.commands.simulate import add_arguments, build_configs
from kvobserve.simulate.cache import PromptLibrary
from kvobserve.simulate.encoders import get_format
from kvobserve.simulate.faults import Action, FaultConfig, FaultPlan
from kvobserve.simulate.profiles import DEFAULT_PERIOD_S, MIN_PERIOD, PROFILES, profile
from kvobserve.simulate.stream import SimStream


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_fits_a_two_rank_worker_once_and_periodically(name: str) -> None:
    PROFILES[name].validate(2)
    p = profile(name, rate=20.0)
    p.validate(2)
    assert p.period == round(DEFAULT_PERIOD_S * 20.0) == 600
    assert p.restart_every == (600 if PROFILES[name].restart_every else 0)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_profile_flag_sets_the_faults_and_fault_flags_override_it() -> None:
    (cfg,) = build_configs(_args("--profile", "gap", "--dp-size", "2"))
    assert cfg.faults.drop_seqs == frozenset({20, 21, 22, 60})
    assert cfg.faults.ranks == (1,)
    assert cfg.faults.period == 1500  # 30 s at the default 50 batches/s
    (cfg,) = build_configs(_args("--profile", "gap", "--drop-seqs", "7", "--rate", "10"))
    assert cfg.faults.drop_seqs == frozenset({7})
    assert (cfg.faults.ranks, cfg.faults.period) == ((1,), 300)


def test_fault_period_flag() -> None:
    (cfg,) = build_configs(_args("--profile", "restart", "--fault-period", "60", "--rate", "20"))
    assert (cfg.faults.period, cfg.faults.restart_every) == (1200, 1200)
    (cfg,) = build_configs(_args("--profile", "gap", "--fault-period", "0"))
    assert cfg.faults == PROFILES["gap"]  # once
    (cfg,) = build_configs(_args("--profile", "stall", "--rate", "0"))
    assert cfg.faults == PROFILES["stall"]  # no rate to measure a period by: once
    (cfg,) = build_configs(_args("--profile", "lost", "--fault-period", "1", "--rate", "5"))
    assert cfg.faults.period == MIN_PERIOD  # every fault of the profile still fits in a period
    (cfg,) = build_configs(_args("--drop-seqs", "3", "--fault-period", "10", "--rate", "20"))
    assert (cfg.faults.drop_seqs, cfg.faults.period) == (frozenset({3}), 200)
    (cfg,) = build_configs(_args("--drop-seqs", "3"))
    assert cfg.faults.period == 0
    with pytest.raises(ValueError, match=r"faults\.drop_seqs: seq 500 is not below period 200"):
        build_configs(_args("--drop-seqs", "500", "--fault-period", "10", "--rate", "20"))


def test_periodic_plan_repeats_every_period_and_once_means_once() -> None:
    f = FaultConfig(drop_seqs=frozenset({2}), ring_drop_seqs=frozenset({3}), period=10)
    plan = FaultPlan(f, 0, 1)
    got = {s: plan.decide(s) for s in range(35)}
    assert [s for s, a in got.items() if a is Action.LIVE_DROP] == [2, 12, 22, 32]
    assert [s for s, a in got.items() if a is Action.RING_DROP] == [3, 13, 23, 33]
    once = FaultPlan(FaultConfig(drop_seqs=frozenset({2})), 0, 1)
    assert [s for s in range(35) if once.decide(s) is Action.LIVE_DROP] == [2]


@pytest.mark.parametrize("name", ["gap", "lost", "malformed", "mixed"])
def test_a_collector_starting_at_any_seq_sees_the_fault_within_one_period(name: str) -> None:
    faults = profile(name, rate=1.0, period_s=120.0)  # a 120-batch period keeps the test short
    fmt = get_format("sglang-0.5.23")
    lib = PromptLibrary(1, fmt.hash_kind, 16, n_prompts=40)
    rank = faults.ranks[0] if faults.ranks else 0
    s = SimStream(fmt, "r.0", "primary", rank, rank, b"", lib, 5, 4096, 16, 10_000, faults)
    for i in range(8 * faults.period):  # bounded: a batch without events does not take a seq
        if s.seq >= 4 * faults.period:
            break
        s.next_batch(float(i))
    assert s.seq == 4 * faults.period
    hit = sorted({*s.live_dropped, *s.ring_dropped, *s.malformed})
    assert len(hit) == 4 * len(PROFILES[name].drop_seqs | PROFILES[name].ring_drop_seqs
                               | PROFILES[name].malformed_seqs)  # fmt: skip
    for start in range(3 * faults.period):  # wherever a late collector starts, one period later
        assert any(start <= seq < start + faults.period for seq in hit)


def test_unknown_profile_names_the_value() -> None:
    with pytest.raises(ValueError, match="--profile: 'nope'"):
        profile("nope")
    with pytest.raises(SystemExit):  # the flag's choices (tests/unit/test_cli.py: the message)
        _args("--profile", "nope")
