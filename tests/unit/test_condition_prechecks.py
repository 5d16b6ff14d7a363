"""Each condition row's cheap pre-check against its check, over generated fleets (property tests).

A stream's condition is found by its row's check; the per-second path (FleetState.conditions)
only builds views of streams some row's pre-check lets through. A pre-check that misses a case
would leave a condition on the page that never fires: these properties hold every row's pre-check
to its check and the per-second path to the whole view, over fleets that tests/unit/
fleet_strategies.py generates (every field of a stream drawn, times at the windows' edges).

Kept fast without proving less: each generated fleet is checked for both properties at once
(one generation, not two), the pool's miss split is sampled at a higher level (a tenth of the
sampled blocks for the same weight; the split's code is the same), and every row is reached in
one pass over the generated fleets rather than one search per row.
"""

from __future__ import annotations

import contextlib

from hypothesis import Phase, given, settings

from kvobserve.analysis.conditions import (
    KINDS,
    PLACEMENT,
    Around,
    Condition,
    active,
    may_have_condition,
)
from kvobserve.wire.snapshot import StreamStats
from tests.examples import examples
from tests.unit.fleet_strategies import NOW, Fleet, fleets, one_field_off

STREAM_KINDS = [k.kind for k in KINDS.values() if k.per_stream]


def _whole(fleet: Fleet) -> list[Condition]:
    state, began = fleet
    v = state.view(NOW)
    v.began = began
    return active(v)


@settings(max_examples=examples(400), deadline=None)
@given(fleets())
def test_prechecks_hold_and_the_per_second_check_finds_what_the_whole_view_shows(
    fleet: Fleet,
) -> None:
    """Every row's pre-check holds wherever its check finds the condition; the per-second check
    finds the same conditions as the whole view, in the same order, each since the same time."""
    state, began = fleet
    v = state.view(NOW)
    v.began = began
    at = Around(v)
    for s in v.streams:
        for kind in STREAM_KINDS:
            k = KINDS[kind]
            if k.find(s, at) is not None:
                assert k.may(s.stats, s.live, NOW), (kind, s.live, s.stats)
    whole = active(v)
    fast = state.conditions(NOW, began)
    assert [(c, c.since) for c in fast] == [(c, c.since) for c in whole]


@settings(max_examples=examples(750), deadline=None)
@given(one_field_off("w", 0))
def test_the_per_second_filter_is_the_rows_prechecks(stats: StreamStats) -> None:
    """`may_have_condition` reads the event kinds' times at once: the same as asking each row
    (each drawn stream live and not: 1,500 cases)."""
    for live in (True, False):
        rows = any(k.may(stats, live, NOW) for k in KINDS.values() if k.per_stream)
        assert may_have_condition(stats, live, NOW) == rows, live


class _AllSeen(Exception):
    """Every wanted condition occurred: generation stops here."""


def test_the_generated_fleets_reach_every_condition() -> None:
    """The properties above are not vacuous: each row's condition occurs in generated fleets,
    and so does a placement condition held on evidence too thin to judge (its hysteresis)."""
    wanted = {*KINDS, "placement_misses held"}
    seen: set[str] = set()

    @settings(max_examples=3000, phases=[Phase.generate], derandomize=True, database=None,
              deadline=None)  # fmt: skip
    @given(fleets())
    def generate(fleet: Fleet) -> None:
        for c in _whole(fleet):
            seen.add(c.kind)
            if c.kind == PLACEMENT and "holds" in c.description:
                seen.add("placement_misses held")
        if seen >= wanted:
            raise _AllSeen

    with contextlib.suppress(_AllSeen):  # the first fleet that completes the set ends the search
        generate()
    assert wanted - seen == set()


def test_a_stream_condition_has_a_precheck_and_the_others_none() -> None:
    """A row is found per stream (an event's time and description, or a check and its
    pre-check) or over the membership (none of them)."""
    for k in KINDS.values():
        assert (k.check is None) == (k.precheck is None), k.kind
        assert bool(k.event_time) == (k.describe is not None), k.kind
        assert not (k.event_time and k.check), k.kind
    assert {"stream_down", "sequence_gap", "cache_thrash", "stream_stalled"} <= set(STREAM_KINDS)
    assert not {"collector_down", "dp_rank_uncovered", "cache_near_full"} & set(STREAM_KINDS)
