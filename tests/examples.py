"""Hypothesis profiles, and how many examples a property runs: its full count under `full` (what
`make test` loads; Hypothesis's own `ci` where CI is set), a tenth under `quick` (`make check`
runs `--hypothesis-profile=quick`). No profile has a deadline: how long an example takes is a
benchmark's question, and on a busy machine a 200 ms deadline fails correct code."""

from __future__ import annotations

from hypothesis import settings

FULL = 100  # Hypothesis's max_examples in `default` and `ci`: a property's count scales by it


def register_profiles() -> None:
    """`full`: Hypothesis's defaults without the deadline, loaded in place of `default` (not of
    `ci`, which already has none); `quick`: the active one at a tenth of the examples."""
    settings.register_profile("full", settings.get_profile("default"), deadline=None)
    if settings.get_current_profile_name() == "default":
        settings.load_profile("full")
    settings.register_profile("quick", settings.default, max_examples=FULL // 10)


def examples(full: int) -> int:
    """`full` under a full profile; a tenth (at least 10) under `quick`."""
    active = settings.default.max_examples
    return full if active >= FULL else max(10, full * active // FULL)
