"""The recency stack (analysis/recency.py): the tokens after a key, against a plain list."""

from __future__ import annotations

import random

import pytest

from kvobserve.analysis.recency import RecencyStack


def _run(seed: int, width: float, slots: int) -> None:
    """Random pushes, pops and trims on the stack and on a list in push order; each pop's
    answer within half of its epoch of the list's exact count (exact with width 1)."""
    rng = random.Random(seed)
    s = RecencyStack(width=width, slots=slots, usual=2)
    model: list[tuple[int, int]] = []  # (key, tokens), oldest first
    for _ in range(400):
        op = rng.random()
        if op < 0.5:
            k, w = rng.randrange(60), rng.choice([2, 2, 2, 1, 5])
            model = [m for m in model if m[0] != k]
            s.push(k, w)
            model.append((k, w))
        elif op < 0.85:
            k = rng.randrange(60)
            got = s.pop(k)
            i = next((i for i, m in enumerate(model) if m[0] == k), None)
            if i is None:
                assert got is None
                continue
            after = sum(w for _, w in model[i + 1 :])
            model.pop(i)
            assert got is not None
            assert abs(got - after) <= width, (got, after)
        else:
            out = s.trim(rng.randrange(40))
            gone = [k for k, _ in model[: len(out)]]  # the oldest leave first (one epoch's
            assert gone == out if width == 1 else sorted(gone) == sorted(out)  # in any order)
            model = model[len(out) :]
        assert s.tokens == sum(w for _, w in model)
        assert len(s) == len(model)


@pytest.mark.parametrize("seed", range(20))
def test_one_epoch_per_push_is_exact(seed: int) -> None:
    _run(seed, width=1, slots=512)


@pytest.mark.parametrize("seed", range(20))
def test_wider_epochs_are_within_one_epoch(seed: int) -> None:
    _run(seed, width=7, slots=512)


def test_a_ring_that_would_wrap_hands_its_oldest_keys_to_the_next_trim() -> None:
    s = RecencyStack(width=1, slots=4, usual=1)
    for k in range(10):
        s.push(k, 1)
    # the open epoch takes one slot: three closed ones are left, seven left as it went round
    assert len(s) == 3 and s.tokens == 3
    assert s.pop(0) is None and s.pop(7) == 2  # 8 and 9 after it
    assert s.trim(100) == [0, 1, 2, 3, 4, 5, 6]  # they are handed out, oldest first
    assert s.held() == [8, 9]


def test_slots_must_be_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="slots=6"):
        RecencyStack(slots=6)
