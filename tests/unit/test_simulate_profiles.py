"""Named fault profiles: each is valid for a 2-rank worker and selectable by flag."""

from __future__ import annotations

import argparse

import pytest

from kvobserve.commands.simulate import add_arguments, build_configs
from kvobserve.simulate.profiles import PROFILES, profile


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_profile_fits_a_two_rank_worker(name: str) -> None:
    PROFILES[name].validate(2)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_profile_flag_sets_the_faults_and_fault_flags_override_it() -> None:
    (cfg,) = build_configs(_args("--profile", "gap", "--dp-size", "2"))
    assert cfg.faults.drop_seqs == frozenset({20, 21, 22, 60})
    assert cfg.faults.ranks == (1,)
    (cfg,) = build_configs(_args("--profile", "gap", "--drop-seqs", "7"))
    assert cfg.faults.drop_seqs == frozenset({7})
    assert cfg.faults.ranks == (1,)


def test_unknown_profile_names_the_value() -> None:
    with pytest.raises(ValueError, match="--profile: 'nope'"):
        profile("nope")
