"""How many examples a Hypothesis property runs: its full count under Hypothesis's own profiles
(`default`; `ci`, which Hypothesis loads itself where CI is set: `make test`), a tenth under
`quick` (`make check` runs `--hypothesis-profile=quick`)."""

from __future__ import annotations

from hypothesis import settings

FULL = 100  # Hypothesis's max_examples in `default` and `ci`: a property's count scales by it


def register_profiles() -> None:
    """`quick`: the active profile (Hypothesis's own where CI is set) at a tenth of the examples."""
    settings.register_profile("quick", settings.default, max_examples=FULL // 10)


def examples(full: int) -> int:
    """`full` under a full profile; a tenth (at least 10) under `quick`."""
    active = settings.default.max_examples
    return full if active >= FULL else max(10, full * active // FULL)
