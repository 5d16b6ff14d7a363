"""Named fault profiles: one fault each (and a mix), for people, tests, the demo and the stack.

`PROFILES` holds each profile's first period: its seq-based faults sit a few dozen batches in, so a
short run shows them once. `profile(name, rate, period_s)` repeats them every `period_s` seconds at
`rate` batches/s, so a collector started at any time sees every fault within one period. Every
profile fits a worker with dp_size >= 2.
"""

from __future__ import annotations

import dataclasses

from kvobserve.simulate.faults import FaultConfig

DEFAULT_PERIOD_S = 30.0
MIN_PERIOD = 100  # batches: every profile's seq-based faults (up to seq 60) fit in one period

PROFILES: dict[str, FaultConfig] = {
    "clean": FaultConfig(),
    # lost on the wire but kept in the replay ring: recovered by replay
    "gap": FaultConfig(ranks=(1,), drop_seqs=frozenset({20, 21, 22, 60})),
    # lost on the wire and from the ring: lost for good
    "lost": FaultConfig(ranks=(1,), ring_drop_seqs=frozenset({30, 31})),
    "restart": FaultConfig(ranks=(0,), restart_every=100),
    "duplicate": FaultConfig(second_publisher=(1,)),
    "mirror": FaultConfig(mirror=((0, 1),)),
    "mislabel": FaultConfig(wrong_rank=((1, 0),)),
    "stray": FaultConfig(stray_publisher=True),
    "malformed": FaultConfig(ranks=(0,), malformed_seqs=frozenset({15, 45})),
    "stall": FaultConfig(ranks=(0,), stall_after=40, stall_s=3.0),
    # rank 1 loses the last batch of a burst on the wire (still in the ring), then idles 6 s with
    # its publisher up: no later batch shows the gap, the collector's tail check finds it
    "tail": FaultConfig(ranks=(1,), drop_seqs=frozenset({39}), stall_after=40, stall_s=6.0),
    # rank 1 drops batches before numbering them: no seq gap; the content shows the loss
    "silent": FaultConfig(ranks=(1,), unnumbered_drops=frozenset({20, 21, 22, 40, 41})),
    # the compose stack: a recovered gap on rank 1 and a second publisher on rank 0
    "mixed": FaultConfig(ranks=(1,), drop_seqs=frozenset(range(50, 55)), second_publisher=(0,)),
}


def period_batches(period_s: float, rate: float) -> int:
    """`period_s` seconds in batches at `rate` batches/s (at least MIN_PERIOD); 0 = once."""
    if period_s <= 0 or rate <= 0:
        return 0  # no period asked for, or no rate to measure it by (--rate 0: as fast as possible)
    return max(MIN_PERIOD, round(period_s * rate))


def profile(name: str, rate: float = 0.0, period_s: float = DEFAULT_PERIOD_S) -> FaultConfig:
    """The named profile, repeating every `period_s` s at `rate`; ValueError naming the value."""
    try:
        base = PROFILES[name]
    except KeyError:
        raise ValueError(
            f"--profile: {name!r} is not a fault profile ({', '.join(PROFILES)})"
        ) from None
    period = period_batches(period_s, rate)
    if not period:
        return base
    # a restart is the one fault that already repeats: once per period, like the others
    restart = period if base.restart_every else 0
    return dataclasses.replace(base, period=period, restart_every=restart)
