"""Named fault profiles: one fault each (and a mix), for tests, the demo and the compose stack.

Seq-based faults are placed early (a few dozen batches in) so that a short run shows them. Every
profile fits a worker with dp_size >= 2.
"""

from __future__ import annotations

from kvobserve.simulate.faults import FaultConfig

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
    # the compose stack: a recovered gap on rank 1 and a second publisher on rank 0
    "mixed": FaultConfig(ranks=(1,), drop_seqs=frozenset(range(50, 55)), second_publisher=(0,)),
}


def profile(name: str) -> FaultConfig:
    """The named profile; ValueError naming the value and the choices."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"--profile: {name!r} is not a fault profile ({', '.join(PROFILES)})"
        ) from None
