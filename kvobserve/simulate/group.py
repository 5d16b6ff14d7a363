"""Several simulated workers in one process: every node of a multi-node worker, shared ports."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kvobserve.simulate.config import SimConfig
from kvobserve.simulate.dynamo_indexer import SimIndexer
from kvobserve.simulate.dynamo_worker import SimulatedDynamoWorker, dynamo_worker_id, indexer_truth
from kvobserve.simulate.ports import free_port_range
from kvobserve.simulate.ranks import Endpoint
from kvobserve.simulate.replay_driver import TraceDriver
from kvobserve.simulate.trace import read_trace
from kvobserve.simulate.truth import TRUTH_VERSION, write_truth
from kvobserve.simulate.worker import SimulatedWorker


def nodes_of(cfg: SimConfig, hosts: Sequence[str] | None = None) -> list[SimConfig]:
    """One config per node of a multi-node worker, sharing one resolved set of port bases.

    Node k binds on `hosts[k]` (default `cfg.node_hosts`, else every node on `cfg.host`). Port 0
    is resolved here once, free on every host, because every node must agree on base + rank.
    HTTP: node 0 serves the engine's API; SGLang nodes >= 1 serve its dummy server only with
    `follower_http`; vLLM nodes >= 1 serve their own API server only with `dp_lb="hybrid"`.
    """
    node_hosts = tuple(hosts) if hosts is not None else cfg.node_hosts
    node_hosts = node_hosts or (cfg.host,) * cfg.nnodes
    cfg = dataclasses.replace(cfg, node_hosts=node_hosts).validate()  # one host per node
    unique = sorted(set(node_hosts))
    n = cfg.dp_size + 1  # + the port past the last rank (stray publisher)
    taken: list[int] = []

    def resolve(port: int | None) -> int | None:
        if port == 0:
            port = free_port_range(unique, n, avoid=taken)
        if port:
            taken.append(port)
        return port

    kv = resolve(cfg.kv_port) if cfg.kv_connect is None else 0  # connecting PUBs: no port
    replay, load = resolve(cfg.replay_port), resolve(cfg.load_port)
    stub = cfg.engine.followers == "stub"  # else an API server per node with hybrid LB
    follower_http = cfg.follower_http if stub else cfg.dp_lb == "hybrid"
    return [
        dataclasses.replace(
            cfg,
            node_rank=r,
            host=node_hosts[r],
            kv_port=kv or 0,
            replay_port=replay,
            load_port=load,
            http_port=cfg.http_port if r == 0 or follower_http else None,
            indexer_port=cfg.indexer_port if r == 0 else None,
            truth_path=None,
        )
        for r in range(cfg.nnodes)
    ]


def shared_indexer(configs: Sequence[SimConfig]) -> SimIndexer | None:
    """One simulated indexer fed by every Dynamo worker of the group (the first config with an
    `indexer_port` describes it), or None."""
    c = next((c for c in configs if c.event_plane and c.indexer_port is not None), None)
    if c is None:
        return None
    miss = None
    if c.indexer_mode == "miss_worker":
        name = c.indexer_miss_worker or c.worker_id
        target = next((x for x in configs if x.worker_id == name), None)
        if target is None:
            raise ValueError(f"indexer_miss_worker: no worker {name!r} in this simulator")
        miss = dynamo_worker_id(target)
    return SimIndexer(c.indexer_mode, c.indexer_lag_events, miss, c.page_size, c.model_name)


def _driver(nodes: list[SimulatedWorker]) -> TraceDriver:
    """The trace replay of one worker: every node of it must run in this process."""
    c = nodes[0].cfg
    if len({w.cfg.node_rank for w in nodes}) != c.nnodes:
        raise ValueError(
            f"trace: worker {c.worker_id} has {c.nnodes} nodes and {len(nodes)} run here; a "
            "replay routes across every rank, so run all nodes in one process (--all-nodes)"
        )
    assert c.trace is not None
    return TraceDriver(nodes, read_trace(c.trace, c.trace_seconds))


class SimulatorGroup:
    """Start and stop many workers together; one combined truth document."""

    def __init__(self, configs: Sequence[SimConfig], truth_path: str | None = None) -> None:
        self.indexer = shared_indexer(configs)
        self.dynamo = [SimulatedDynamoWorker(c, self.indexer) for c in configs if c.event_plane]
        self.workers: list[SimulatedWorker | SimulatedDynamoWorker] = [*self.dynamo]
        engines = [SimulatedWorker(c) for c in configs if not c.event_plane]
        self.workers += engines
        self.truth_path = truth_path
        nodes: dict[tuple[str, int], list[SimulatedWorker]] = {}
        for w in engines:
            nodes.setdefault((w.cfg.worker_id, w.cfg.nnodes), []).append(w)
        for group in nodes.values():  # the nodes of one worker see each other's ranks
            for w in group:
                w.peers = [p for p in group if p.cfg.node_rank != w.cfg.node_rank]
        self.replays = [_driver(group) for group in nodes.values() if group[0].cfg.trace]

    def start(self) -> SimulatorGroup:
        """Start every worker; on a failure, stop the ones already started and re-raise."""
        started: list[SimulatedWorker | SimulatedDynamoWorker] = []
        try:
            if self.indexer is not None:
                c = next(c.cfg for c in self.dynamo if c.cfg.indexer_port is not None)
                self.indexer.start(c.host, c.indexer_port or 0)
            for w in self.workers:
                started.append(w.start())
            for d in self.replays:
                d.start()
        except BaseException:
            for d in self.replays:
                d.stop()
            for w in started:
                w.stop()
            if self.indexer is not None:
                self.indexer.stop()
            raise
        return self

    def endpoints(self) -> list[Endpoint]:
        """All endpoints of all workers (and the simulated indexer's)."""
        out = [e for w in self.workers for e in w.endpoints()]
        if self.indexer is not None:
            c = next(w.cfg for w in self.dynamo if w.cfg.indexer_port is not None)
            out.append(Endpoint("-", "indexer", None, f"http://{c.host}:{self.indexer.port}"))
        return out

    def truth(self) -> dict[str, Any]:
        """`{"truth_version", "workers": [one worker's truth, ...][, "indexer": {...}]}`."""
        doc = {"truth_version": TRUTH_VERSION, "workers": [w.truth() for w in self.workers]}
        if self.indexer is not None:
            doc["indexer"] = indexer_truth(self.indexer, self.dynamo)
        if self.replays:
            doc["replays"] = [d.truth() for d in self.replays]
        return doc

    def write_truth(self) -> None:
        """Write the combined truth file, if one was asked for."""
        if self.truth_path:
            write_truth(self.truth_path, self.truth())

    def stop(self) -> None:
        """Stop every worker, then write the final truth; idempotent."""
        for d in self.replays:
            d.stop()
        for w in self.workers:
            w.stop()
        if self.indexer is not None:
            self.indexer.stop()
        self.write_truth()

    def __enter__(self) -> SimulatorGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
