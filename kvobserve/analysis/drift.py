"""Router-index drift: a router's view of one stream's blocks against the event-derived index.

Pure set arithmetic, no I/O. The router's answer (a `/dump`) is taken at some moment inside a
comparison window; every block stored or removed during the window (`touched`, which starts
`drift_lag_s` before the request and ends `drift_lag_s` after the answer) may legitimately differ
between the two views, so it is counted as `in_flight` and neither phantom nor missing. A block
outside `touched` has the same residency in kvobserve's index during the whole window, so the
index at the window's end stands for it (docs/dynamo.md "Drift").
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Drift:
    """The comparison of one (stream, medium)."""

    router_blocks: int
    engine_blocks: int
    phantom: int  # the router holds it, the engine evicted it
    missing: int  # the engine holds it, the router lacks it
    in_flight: int  # differs, but changed during the window: not counted either way
    jaccard: float | None  # |both| / |either| over settled blocks (1.0 when both are empty)


def compare_blocks(router: Set[Any], engine: Set[Any], touched: Set[Any]) -> Drift:
    """Block-set comparison; `touched` blocks are in flight, not drift."""
    if touched:
        r, e = router - touched, engine - touched
        in_flight = len((router ^ engine) & touched)
    else:
        r, e, in_flight = router, engine, 0
    phantom, missing = len(r - e), len(e - r)
    both = len(r) - phantom
    either = both + phantom + missing
    jaccard = both / either if either else 1.0
    return Drift(len(router), len(engine), phantom, missing, in_flight, jaccard)


def compare_sizes(router_blocks: int, engine_blocks: int, touched: int) -> Drift:
    """Size-only comparison (a router that reports tree sizes, not blocks).

    A size difference proves at least that many phantom (router larger) or missing (router
    smaller) blocks beyond what the window's `touched` blocks can explain; drift that cancels
    out (as many phantom as missing blocks) is invisible to it. No Jaccard similarity.
    """
    excess = router_blocks - engine_blocks
    phantom = max(0, excess - touched)
    missing = max(0, -excess - touched)
    in_flight = min(abs(excess), touched)
    return Drift(router_blocks, engine_blocks, phantom, missing, in_flight, None)
