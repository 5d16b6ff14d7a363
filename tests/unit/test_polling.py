"""The suite's poll helper (tests/polling.py): what it returns, and what its failure says."""

from __future__ import annotations

import itertools

import pytest

from tests.polling import until, until_async


def test_until_returns_the_first_truthy_value() -> None:
    calls = itertools.count(1)
    assert until(
        lambda: [n] if (n := next(calls)) >= 4 else [], 10, "four calls", interval_s=0
    ) == [4]
    assert next(calls) == 5  # not called again once it held


def test_a_timeout_says_what_was_awaited_the_last_value_and_the_description() -> None:
    with pytest.raises(AssertionError) as err:
        until(lambda: {"gaps": 2}.get("replays", 0), 0, "one replay", lambda: "replay state: idle")
    text = str(err.value)
    assert text.startswith("not true after 0 s: one replay\n")
    assert "last value: 0\n" in text and text.endswith("replay state: idle")


def test_retried_exceptions_are_a_falsy_value_and_others_propagate() -> None:
    def refused() -> bool:
        raise ConnectionRefusedError("nothing listens")

    with pytest.raises(AssertionError, match="last value: ConnectionRefusedError"):
        until(refused, 0, "the server up", retry_on=(OSError,))
    with pytest.raises(ConnectionRefusedError):
        until(refused, 10, "the server up", retry_on=(ValueError,))


def test_progress_moves_the_deadline_while_it_changes() -> None:
    moves = itertools.count()
    checks = itertools.count(1)

    def progress() -> int:
        return min(next(moves), 20)  # moves on the first 20 reads, then stands still

    with pytest.raises(AssertionError, match=r"not true after 0\.2 s without progress: done"):
        until(lambda: next(checks) and False, 0.2, "done", progress=progress, interval_s=0)
    assert next(checks) > 20  # polled on while the work went on


def test_a_wait_must_say_what_it_awaits() -> None:
    with pytest.raises(ValueError, match="say what is awaited"):
        until(lambda: True, 1, "")


async def test_until_async_awaits_a_coroutine_check() -> None:
    calls = itertools.count(1)

    async def check() -> int:
        n = next(calls)
        return n if n >= 3 else 0

    assert await until_async(check, 10, "three calls", interval_s=0) == 3
    with pytest.raises(AssertionError, match="last value: 0"):
        await until_async(lambda: 0, 0, "never")
