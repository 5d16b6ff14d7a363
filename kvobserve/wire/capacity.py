"""The per-rank capacity curve in a collector's snapshot (analysis/capacity.py `RankCurve`).

A collector ships one `RankCurveStats` per rank it follows every `interval_s` (60 s: the curves
move slowly), in `Snapshot.curves`; a snapshot without them says nothing new (the aggregator
keeps the last ones it got, analysis/capacity_fleet.py). Every count is cumulative since the
collector process started, except `evicted` and `evicted_tokens` (since the start, the last
clear or reset: what the points' validity rests on). Depth bins: x = depth / `basis_tokens`,
bin 0 below 2^-5, then 8 per octave up to 2^3, then one above (analysis/capacity.py `BINS`).
Array-encoded: the fields are positional, new ones go at the end with defaults.
"""

from __future__ import annotations

from msgspec import Struct


class RankCurveStats(Struct, array_like=True, omit_defaults=True, gc=False):
    """One rank's curve data, as its collector's `RankCurve` holds it."""

    worker_id: str
    dp_rank: int
    level: int  # 2^-level of the blocks are followed
    basis_tokens: int  # what the depth bins are measured in: the capacity (or the high-water mark)
    basis_configured: bool  # the basis is the configured capacity ([worker] capacity_tokens)
    stores: int  # top-tier blocks stored (every hash of every store event)
    sampled_stores: int
    restores: list[int]  # sampled re-stores of evicted blocks, by depth bin
    beyond: float = 0.0  # re-stores of blocks evicted past the horizon (weighed): unlimited only
    evicted: int = 0  # top-tier blocks removed since the start, the last clear or reset
    evicted_tokens: int = 0
    resets: int = 0  # clears and resets (each empties the ghost list)
    ghosts: int = 0  # ghost-list entries held (memory)
    beyond_keys: int = 0  # keys kept past the horizon (memory)
    below: list[int] = []  # opt-in: sampled blocks of hit paths by depth bin
    walked: int = 0  # opt-in: blocks on the hit paths of requests that stored (every one)
    walked_sampled: int = 0
    block_size: int = 0  # tokens of the rank's usual block
