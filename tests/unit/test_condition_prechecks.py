"""Each stream condition's pre-check holds wherever its check finds it, over generated fleets.

The per-second check (`FleetState.conditions`) looks only at the streams some row's pre-check
lets through; the API and the page (`active(view)`) look at every stream. A pre-check that
missed a case would leave a condition on the page that never fires as a transition or event.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st

from kvobserve.analysis.conditions import (
    KINDS,
    Around,
    Condition,
    active,
    may_have_condition,
)
from kvobserve.wire.snapshot import StreamStats
from tests.unit.fleet_strategies import NOW, Fleet, fleets, one_field_off

STREAM_KINDS = [k.kind for k in KINDS.values() if k.per_stream]


def _whole(fleet: Fleet) -> list[Condition]:
    state, began = fleet
    v = state.view(NOW)
    v.began = began
    return active(v)


@settings(max_examples=400, deadline=None)
@given(fleets())
def test_every_rows_precheck_holds_where_its_check_finds_the_condition(fleet: Fleet) -> None:
    state, began = fleet
    v = state.view(NOW)
    v.began = began
    at = Around(v)
    for s in v.streams:
        for kind in STREAM_KINDS:
            k = KINDS[kind]
            if k.find(s, at) is not None:
                assert k.may(s.stats, s.live, NOW), (kind, s.live, s.stats)


@settings(max_examples=400, deadline=None)
@given(fleets())
def test_the_per_second_check_finds_what_the_whole_view_shows(fleet: Fleet) -> None:
    """The same conditions, in the same order, each since the same time."""
    state, began = fleet
    whole = _whole(fleet)
    fast = state.conditions(NOW, began)
    assert [(c, c.since) for c in fast] == [(c, c.since) for c in whole]


@settings(max_examples=1500, deadline=None)
@given(one_field_off("w", 0), st.booleans())
def test_the_per_second_filter_is_the_rows_prechecks(stats: StreamStats, live: bool) -> None:
    """`may_have_condition` reads the event kinds' times at once: the same as asking each row."""
    rows = any(k.may(stats, live, NOW) for k in KINDS.values() if k.per_stream)
    assert may_have_condition(stats, live, NOW) == rows


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_generated_fleets_reach_every_condition(kind: str) -> None:
    """The properties above are not vacuous: each row's condition occurs in generated fleets."""

    def has(fleet: Fleet) -> bool:
        return any(c.kind == kind for c in _whole(fleet))

    once = settings(max_examples=3000, phases=[Phase.generate], derandomize=True, database=None)
    found: Any = find(fleets(), has, settings=once)  # the first one: no shrinking
    assert has(found)


def test_a_stream_condition_has_a_precheck_and_the_others_none() -> None:
    """A row is found per stream (an event's time and description, or a check and its
    pre-check) or over the membership (none of them)."""
    for k in KINDS.values():
        assert (k.check is None) == (k.precheck is None), k.kind
        assert bool(k.event_time) == (k.describe is not None), k.kind
        assert not (k.event_time and k.check), k.kind
    assert {"stream_down", "sequence_gap", "cache_thrash", "stream_stalled"} <= set(STREAM_KINDS)
    assert not {"collector_down", "dp_rank_uncovered", "cache_near_full"} & set(STREAM_KINDS)
