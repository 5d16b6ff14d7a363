"""Several simulated workers in one process: every node of a multi-node worker, shared ports."""

from __future__ import annotations

import dataclasses
import random
import socket
from collections.abc import Sequence
from typing import Any

from kvobserve.simulate.config import SimConfig
from kvobserve.simulate.truth import TRUTH_VERSION, write_truth
from kvobserve.simulate.worker import Endpoint, SimulatedWorker

_rng = random.Random()


def free_port_range(host: str, count: int, attempts: int = 50) -> int:
    """A base port whose next `count` TCP ports were all free a moment ago."""
    for _ in range(attempts):
        base = _rng.randrange(20000, 60000 - count)
        socks: list[socket.socket] = []
        try:
            for off in range(count):
                s = socket.socket()
                socks.append(s)
                s.bind((host, base + off))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise OSError(f"no {count} consecutive free ports on {host}")


def nodes_of(cfg: SimConfig) -> list[SimConfig]:
    """One config per node of a multi-node worker, sharing one resolved set of port bases.

    Port 0 is resolved here once, because every node must agree on base + rank. Only node 0
    (the leader) serves HTTP.
    """
    n = cfg.dp_size + 1  # + the port past the last rank (stray publisher)
    kv = cfg.kv_port or free_port_range(cfg.host, n)
    replay = cfg.replay_port
    if replay == 0:
        replay = free_port_range(cfg.host, n)
    load = cfg.load_port
    if load == 0:
        load = free_port_range(cfg.host, n)
    return [
        dataclasses.replace(
            cfg,
            node_rank=r,
            kv_port=kv,
            replay_port=replay,
            load_port=load,
            http_port=cfg.http_port if r == 0 else None,
            truth_path=None,
        )
        for r in range(cfg.nnodes)
    ]


class SimulatorGroup:
    """Start and stop many workers together; one combined truth document."""

    def __init__(self, configs: Sequence[SimConfig], truth_path: str | None = None) -> None:
        self.workers = [SimulatedWorker(c) for c in configs]
        self.truth_path = truth_path

    def start(self) -> SimulatorGroup:
        """Start every worker; on a failure, stop the ones already started and re-raise."""
        started: list[SimulatedWorker] = []
        try:
            for w in self.workers:
                started.append(w.start())
        except BaseException:
            for w in started:
                w.stop()
            raise
        return self

    def endpoints(self) -> list[Endpoint]:
        """All endpoints of all workers."""
        return [e for w in self.workers for e in w.endpoints()]

    def truth(self) -> dict[str, Any]:
        """`{"truth_version", "workers": [one worker's truth, ...]}`."""
        return {"truth_version": TRUTH_VERSION, "workers": [w.truth() for w in self.workers]}

    def write_truth(self) -> None:
        """Write the combined truth file, if one was asked for."""
        if self.truth_path:
            write_truth(self.truth_path, self.truth())

    def stop(self) -> None:
        """Stop every worker, then write the final truth; idempotent."""
        for w in self.workers:
            w.stop()
        self.write_truth()

    def __enter__(self) -> SimulatorGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
