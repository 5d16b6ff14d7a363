"""Fault injection settings and the per-batch fault decision of one publisher instance."""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import Enum
from typing import Any

# Malformed payloads: each fails msgpack decoding (the collector counts reason "msgpack").
MALFORMED_PAYLOADS: tuple[bytes, ...] = (
    b"\x93\xcb\x41\xda",  # a batch array whose float64 ts is cut short
    b"\xc1",  # the one byte msgpack never uses
    b"\x93\xcb\x41\xda\xc0\x7e\xdb\x59\x14\x5e\x91\x96\xab",  # truncated inside the first event
)


class Action(Enum):
    """What happens to one batch."""

    SEND = 0
    LIVE_DROP = 1  # lost on the wire (PUB high-water mark), still in the replay ring
    RING_DROP = 2  # lost on the wire and never in the replay ring
    MALFORMED = 3  # sent, but the payload does not decode


@dataclass(frozen=True)
class FaultConfig:
    """Faults of one simulated worker. Seq-based and rate-based faults hit `ranks` (None = all).

    With `period` > 0 the seq-based faults and the stall repeat: they hit every seq whose
    `seq % period` is listed, in every publisher instance. 0 = each happens once.
    """

    ranks: tuple[int, ...] | None = None
    drop_seqs: frozenset[int] = frozenset()
    drop_rate: float = 0.0
    ring_drop_seqs: frozenset[int] = frozenset()
    ring_drop_rate: float = 0.0
    malformed_seqs: frozenset[int] = frozenset()
    malformed_rate: float = 0.0
    restart_every: int = 0  # restart the publisher each time an instance reached this many batches
    restart_pause_s: float = 0.5  # the engine "boots" this long (subscribers reconnect meanwhile)
    stall_after: int = 0  # after this many batches, publish nothing for stall_s (once per period)
    stall_s: float = 0.0
    second_publisher: tuple[int, ...] = ()  # ranks with a second, interleaved publisher
    mirror: tuple[tuple[int, int], ...] = ()  # (source rank, mirror rank)
    wrong_rank: tuple[tuple[int, int], ...] = ()  # (rank, label written at batch position 2)
    stray_publisher: bool = False  # an extra publisher on kv base + dp_size
    period: int = 0  # batches; seq-based faults and the stall repeat with it; 0 = once
    # Dynamo mode: the message carrying each of these event_ids is lost on the event plane
    drop_event_ids: frozenset[int] = frozenset()

    def applies(self, rank: int) -> bool:
        """Whether the seq/rate/restart/stall faults hit this rank."""
        return self.ranks is None or rank in self.ranks

    def label_for(self, rank: int) -> int:
        """The rank label this rank writes into its batches."""
        for r, label in self.wrong_rank:
            if r == rank:
                return label
        return rank

    def validate(self, dp_size: int) -> None:
        """ValueError naming the field and value when a setting cannot apply to dp_size ranks."""
        for name in ("drop_rate", "ring_drop_rate", "malformed_rate"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"faults.{name}: {v!r} is not a probability in [0, 1]")
        for name in ("restart_every", "stall_after", "period"):
            if getattr(self, name) < 0:
                raise ValueError(f"faults.{name}: {getattr(self, name)!r} must be >= 0")
        if self.period:
            for name in ("drop_seqs", "ring_drop_seqs", "malformed_seqs"):
                late = [s for s in getattr(self, name) if s >= self.period]
                if late:
                    raise ValueError(
                        f"faults.{name}: seq {min(late)} is not below period {self.period}"
                    )
            if self.stall_after >= self.period:
                raise ValueError(
                    f"faults.stall_after: {self.stall_after} is not below period {self.period}"
                )
        if any(i < 1 for i in self.drop_event_ids):
            raise ValueError(
                f"faults.drop_event_ids: {sorted(self.drop_event_ids)} (ids start at 1)"
            )
        if self.stall_s < 0 or self.restart_pause_s < 0:
            raise ValueError("faults.stall_s / restart_pause_s: must be >= 0")
        ranks_used = [("faults.ranks", r) for r in (self.ranks or ())] + [
            ("faults.second_publisher", r) for r in self.second_publisher
        ]
        ranks_used += [("faults.mirror", r) for pair in self.mirror for r in pair]
        ranks_used += [("faults.wrong_rank", r) for r, _ in self.wrong_rank]
        for name, r in ranks_used:
            if not 0 <= r < dp_size:
                raise ValueError(f"{name}: rank {r!r} is outside 0..{dp_size - 1}")
        for src, dst in self.mirror:
            if src == dst:
                raise ValueError(f"faults.mirror: {src}:{dst} mirrors a rank onto itself")


class FaultPlan:
    """Per-instance fault decisions; deterministic for a given seed."""

    __slots__ = ("_active", "_cfg", "_period", "_rates", "_rng")

    def __init__(self, cfg: FaultConfig, rank: int, seed: int) -> None:
        self._cfg = cfg
        self._active = cfg.applies(rank) and bool(
            cfg.drop_seqs
            or cfg.ring_drop_seqs
            or cfg.malformed_seqs
            or cfg.drop_rate
            or cfg.ring_drop_rate
            or cfg.malformed_rate
        )
        self._rates = cfg.drop_rate or cfg.ring_drop_rate or cfg.malformed_rate
        self._period = cfg.period
        self._rng = random.Random(seed)

    def decide(self, seq: int) -> Action:
        """The fate of the batch with this seq."""
        if not self._active:
            return Action.SEND
        c = self._cfg
        at = seq % self._period if self._period else seq
        if at in c.ring_drop_seqs:
            return Action.RING_DROP
        if at in c.drop_seqs:
            return Action.LIVE_DROP
        if at in c.malformed_seqs:
            return Action.MALFORMED
        if self._rates:
            x = self._rng.random()
            if x < c.ring_drop_rate:
                return Action.RING_DROP
            x -= c.ring_drop_rate
            if x < c.drop_rate:
                return Action.LIVE_DROP
            x -= c.drop_rate
            if x < c.malformed_rate:
                return Action.MALFORMED
        return Action.SEND


def parse_int_list(name: str, text: str) -> tuple[int, ...]:
    """'3,4,10' -> (3, 4, 10); ValueError naming the flag otherwise."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{name}: {text!r} is not a comma-separated list of integers") from None


def parse_pairs(name: str, text: str) -> tuple[tuple[int, int], ...]:
    """'0:1,2:3' -> ((0, 1), (2, 3)); ValueError naming the flag otherwise."""
    out: list[tuple[int, int]] = []
    for part in (p for p in text.split(",") if p.strip()):
        a, sep, b = part.partition(":")
        try:
            if not sep:
                raise ValueError
            out.append((int(a), int(b)))
        except ValueError:
            raise ValueError(f"{name}: {part!r} is not RANK:RANK") from None
    return tuple(out)


_FIELDS = set(FaultConfig.__dataclass_fields__)


def faults_from_dict(d: dict[str, Any]) -> FaultConfig:
    """A FaultConfig from a TOML table; unknown keys are errors that name the key."""
    kw: dict[str, Any] = {}
    for k, v in d.items():
        if k not in _FIELDS:
            raise ValueError(f"faults.{k}: unknown key (known: {', '.join(sorted(_FIELDS))})")
        if k in ("drop_seqs", "ring_drop_seqs", "malformed_seqs", "drop_event_ids"):
            kw[k] = frozenset(int(x) for x in v)
        elif k in ("mirror", "wrong_rank"):
            kw[k] = tuple((int(a), int(b)) for a, b in v)
        elif k in ("ranks", "second_publisher"):
            kw[k] = tuple(int(x) for x in v)
        else:
            kw[k] = v
    return FaultConfig(**kw)
