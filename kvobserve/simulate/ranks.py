"""A simulated node's state: per-rank sockets and publisher instances, the endpoints it prints,
and what its HTTP server, discovery answers, side channels and truth read of it (`Node`)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from kvobserve.simulate.config import SimConfig
from kvobserve.simulate.stream import SimStream
from kvobserve.simulate.wire_format import WireFormat


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


class Node(Protocol):
    """A simulated engine node as its parts read it (simulate/worker.py `SimulatedWorker`)."""

    cfg: SimConfig
    fmt: WireFormat
    ranks: list[RankState]
    stray: RankState | None  # the publisher past the last rank (a fault), if any
    bind_failures: list[str]
    kv_base: int
    replay_base: int | None
    load_base: int | None
    http_port: int | None

    @property
    def peers(self) -> Sequence[Node]:
        """The other nodes of this worker in this process (a vLLM head's API server reads them)."""
        ...
