"""Per-rank socket and publisher-instance state, and the endpoints a worker prints."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq

from kvobserve.simulate.stream import SimStream


@dataclass(frozen=True)
class Endpoint:
    """One endpoint a simulated worker serves."""

    worker_id: str
    kind: str  # kv | replay | load | kv_metrics | stray | http | bind_failed
    dp_rank: int | None
    url: str

    def line(self) -> str:
        """The machine-readable line `simulate` prints."""
        rank = "-" if self.dp_rank is None else str(self.dp_rank)
        return f"endpoint worker={self.worker_id} kind={self.kind} dp_rank={rank} url={self.url}"


class RankState:
    """Sockets and publisher instances of one DP rank (or of the stray publisher)."""

    def __init__(self, rank: int, port: int, replay_port: int | None) -> None:
        self.rank = rank
        self.port = port
        self.replay_port = replay_port
        self.pub: zmq.Socket[Any] | None = None
        self.router: zmq.Socket[Any] | None = None
        self.streams: list[SimStream] = []  # [primary] or [primary, second publisher]
        self.past: list[SimStream] = []  # instances ended by a restart
        self.mirrors: list[RankState] = []  # ranks whose ports carry copies of this rank's batches
        self.mirror_of: int | None = None
        self.mirror_ring: deque[tuple[int, bytes, bytes]] = deque()
        self.paused_until = 0.0
        self.stall_at = math.inf  # the seq of the primary instance at which it stalls next
        self.restarts = 0
        self.load: zmq.Socket[Any] | None = None
        self.load_seq = 0
        self.push: zmq.Socket[Any] | None = None
        self.side_dropped = 0
        self.replay_requests = 0  # replay requests answered
        self.replay_batches = 0  # batches sent in those answers (end markers not counted)

    @property
    def ring(self) -> deque[tuple[int, bytes, bytes]]:
        """The replay ring this rank's ROUTER serves."""
        return self.mirror_ring if self.mirror_of is not None else self.streams[0].ring
