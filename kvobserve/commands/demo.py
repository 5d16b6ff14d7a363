"""`kvobserve demo`: a simulated fleet with faults, its collectors and the aggregator, one process.

The fleet: a 2-node SGLang 0.5.23 DP-attention worker (dp_size 8, ranks 0-3 on node 0 at
127.0.0.1 and 4-7 on node 1 at 127.0.0.2, one collector per node, each at its own address, both
configured with node 0's URL only; the load publisher and every node's /metrics on) and a
single-node vLLM 0.33 worker (dp_size 4, its own collector).
The fault schedule, at the default 20 batches/s per rank: SGLang ranks 2 and 5 lose batches
200-204 on the wire (kept in the replay ring, so the collectors recover them, ~10 s in) and restart
their publishers every 1,000 batches (~50 s); vLLM rank 1 has a second publisher on its endpoint
from the start (a duplicate stream). With `--dynamo`, a Dynamo worker joins (dp_size 4 on the ZMQ
direct event plane, rank 2 loses the messages of event ids 400-401) with its own collector, and a
simulated Dynamo KV indexer that loses removals (phantom blocks grow as the caches evict), for
router-index drift (docs/dynamo.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import sys
import time
from dataclasses import dataclass
from typing import TextIO

from kvobserve.analysis.conditions import active
from kvobserve.commands.common import fail, load, stop_event
from kvobserve.commands.embedded import Embedded, start_embedded
from kvobserve.config import (
    CollectorConfig,
    Config,
    ConfigError,
    HttpConfig,
    WorkerConfig,
    add_config_flags,
)
from kvobserve.simulate import FaultConfig, SimulatedWorker, nodes_of
from kvobserve.simulate.config import SimConfig
from kvobserve.simulate.dynamo_worker import SimulatedDynamoWorker
from kvobserve.simulate.ports import free_port_range
from kvobserve.simulate.truth import write_truth

DEMO_FAULTS_SGLANG = FaultConfig(
    ranks=(2, 5), drop_seqs=frozenset(range(200, 205)), restart_every=1000
)
DEMO_FAULTS_VLLM = FaultConfig(second_publisher=(1,))


@dataclass
class Demo:
    """The running demo: simulated engines and the embedded kvobserve."""

    sims: list[SimulatedWorker | SimulatedDynamoWorker]
    kvobserve: Embedded
    configs: list[Config]

    async def close(self) -> None:
        """Stop kvobserve and the engines concurrently (well within 2 s)."""
        loop = asyncio.get_running_loop()
        stops = [loop.run_in_executor(None, s.stop, 1.0) for s in self.sims]
        await asyncio.gather(self.kvobserve.close(), *stops)

    def truth(self) -> dict[str, object]:
        """The engines' ground truth now."""
        return {"truth_version": 1, "workers": [s.truth() for s in self.sims]}


SGLANG_HOSTS = ("127.0.0.1", "127.0.0.2")  # the SGLang worker's two nodes


def _collector_config(
    cid: str, node_rank: int, nnodes: int, worker: WorkerConfig, interval_s: float, host: str
) -> Config:
    # no checkpoints: the demo's engines are new at every start, so any checkpoint of an
    # earlier demo would be another plan's (ignored, with an event on the page)
    node = CollectorConfig(cid, node_rank, nnodes, interval_s, host, checkpoint_interval_s=0.0)
    return Config("demo", node, (dataclasses.replace(worker, leader=node_rank == 0),))


def _sglang_worker(node0: SimulatedWorker) -> WorkerConfig:
    """The one [[worker]] table every SGLang node uses: node 0's URL, each node's own /metrics."""
    c = node0.cfg
    return WorkerConfig(
        id=c.worker_id,
        engine="sglang",
        url=f"http://{c.host}:{node0.http_port}",
        dp_size=None,  # endpoints, dp_size, attention DP and the load PUB: from /server_info
        metrics_url=f"http://*:{node0.http_port}/metrics",  # every node's own engine
    )


def _worker_config(sim: SimulatedWorker, engine: str, leader: bool) -> WorkerConfig:
    c = sim.cfg
    return WorkerConfig(
        id=c.worker_id,
        engine=engine,
        kv_endpoint=f"tcp://{c.host}:{sim.kv_base}",
        replay_endpoint=f"tcp://{c.host}:{sim.replay_base}" if sim.replay_base else None,
        topic=c.topic,
        dp_size=c.dp_size,
        dp_attention=c.dp_attention,
        metrics_url=f"http://{c.host}:{sim.http_port}/metrics"
        if leader and sim.http_port
        else None,
        leader=leader,
    )


def _dynamo_sim(rate: float, seed: int) -> SimulatedDynamoWorker:
    cfg = SimConfig(
        worker_id="dynamo-dp4", format="vllm-0.33", dp_size=4, event_plane="zmq", rate=rate,
        seed=seed + 2, start_delay_s=0.5, http_port=None, replay_port=None, indexer_port=0,
        indexer_mode="lose_removals", capacity_tokens=4096,
        faults=FaultConfig(ranks=(2,), drop_event_ids=frozenset({400, 401})),
    )  # fmt: skip
    return SimulatedDynamoWorker(cfg).start()


def _dynamo_config(sim: SimulatedDynamoWorker, drift_interval_s: float) -> WorkerConfig:
    eps = tuple(e.url for e in sim.endpoints() if e.kind in ("dynamo_kv", "dynamo_metrics"))
    indexer = next(e.url for e in sim.endpoints() if e.kind == "indexer")
    return WorkerConfig(
        id="dynamo", engine="dynamo", event_plane="zmq", zmq_endpoints=eps, block_size=16,
        dp_size=4, capacity_tokens=sim.cfg.capacity_tokens, indexer_url=indexer,
        drift_interval_s=drift_interval_s, drift_lag_s=min(1.0, drift_interval_s / 4),
    )  # fmt: skip


async def start_demo(
    http: HttpConfig | None,
    *,
    rate: float = 20.0,
    interval_s: float = 1.0,
    seed: int = 0,
    sglang_faults: FaultConfig = DEMO_FAULTS_SGLANG,
    vllm_faults: FaultConfig = DEMO_FAULTS_VLLM,
    dynamo: bool = False,
    drift_interval_s: float = 10.0,
) -> Demo:
    """Start the simulated fleet and kvobserve; serve `http` (None: no HTTP)."""
    sglang = SimConfig(
        worker_id="sglang-dp8",
        format="sglang-0.5.23",
        dp_size=8,
        nnodes=2,
        dp_attention=True,
        topic="kv-events",
        rate=rate,
        seed=seed,
        faults=sglang_faults,
        load_port=0,  # --load-publish-endpoint: every rank's usage on its own node
        follower_http=True,  # node 1's dummy server serves /metrics of its ranks
        http_port=free_port_range(SGLANG_HOSTS, 1),  # the same --port on both nodes
    )
    vllm = SimConfig(
        worker_id="vllm-dp4",
        format="vllm-0.33",
        dp_size=4,
        rate=rate,
        seed=seed + 1,
        faults=vllm_faults,
    )
    sims: list[SimulatedWorker | SimulatedDynamoWorker] = []
    try:
        for cfg in [*nodes_of(sglang.validate(), SGLANG_HOSTS), vllm.validate()]:
            sims.append(SimulatedWorker(dataclasses.replace(cfg, start_delay_s=0.5)).start())
        if dynamo:
            sims.append(_dynamo_sim(rate, seed))
    except BaseException:
        for s in sims:
            s.stop()
        raise
    sg0, sg1, vl = (s for s in sims if isinstance(s, SimulatedWorker))
    sg = _sglang_worker(sg0)
    configs = [
        _collector_config("sglang-node-0", 0, 2, sg, interval_s, sg0.cfg.host),
        _collector_config("sglang-node-1", 1, 2, sg, interval_s, sg1.cfg.host),
        _collector_config(
            "vllm-node-0", 0, 1, _worker_config(vl, "vllm", True), interval_s, vl.cfg.host
        ),
    ]
    for s in sims:
        if isinstance(s, SimulatedDynamoWorker):
            w = _dynamo_config(s, drift_interval_s)
            configs.append(_collector_config("dynamo-node-0", 0, 1, w, interval_s, "127.0.0.1"))
    try:
        emb = await start_embedded(configs, http)
    except BaseException:
        for s in sims:
            s.stop()
        raise
    return Demo(sims, emb, configs)


def summary_line(demo: Demo, last: tuple[float, int] | None) -> tuple[str, tuple[float, int]]:
    """`streams 12/12 up · 1,234 events/s · gaps 2 (recovered 10, lost 0) · conditions: ...`."""
    view = demo.kvobserve.aggregator.view()
    now = time.monotonic()
    events = sum(sum(s.stats.events.values()) for s in view.streams)
    rate = 0.0
    if last is not None and now > last[0]:
        rate = (events - last[1]) / (now - last[0])
    up = sum(1 for s in view.streams if s.up)
    gaps = sum(s.stats.gaps for s in view.streams)
    recovered = sum(s.stats.recovered for s in view.streams)
    lost = sum(s.stats.lost for s in view.streams)
    restarts = sum(s.stats.restarts for s in view.streams)
    kinds: dict[str, int] = {}
    for c in active(view):
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
    conds = ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())) or "none"
    line = (
        f"streams {up}/{len(view.streams)} up · {rate:,.0f} events/s · gaps {gaps} "
        f"(recovered {recovered}, lost {lost}) · restarts {restarts} · conditions: {conds}"
    )
    return line, (now, events)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvobserve demo`: its HTTP ([http]: --listen, auth, TLS) and the simulation."""
    add_config_flags(parser, ("http",))
    parser.add_argument("--rate", type=float, default=20.0, help="batches/s per DP rank")
    parser.add_argument("--interval", type=float, default=1.0, help="snapshot interval, seconds")
    parser.add_argument("--duration", type=float, default=0.0, help="stop after S seconds (0: run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--truth", help="write the engines' ground truth here (JSON) at the end")
    parser.add_argument(
        "--dynamo",
        action="store_true",
        help="add a Dynamo worker (ZMQ direct event plane) and a simulated KV indexer that loses "
        "removals (router-index drift)",
    )


def run(args: argparse.Namespace) -> int:
    """`kvobserve demo`."""
    if args.rate <= 0 or args.interval <= 0:
        return fail("demo", f"--rate {args.rate} / --interval {args.interval}: must be > 0")
    try:
        http = load(args).http
    except ConfigError as exc:
        return fail("demo", exc)
    return asyncio.run(_demo(args, http, sys.stdout))


async def _demo(args: argparse.Namespace, http: HttpConfig, out: TextIO) -> int:
    # The injected faults would log state changes all over the summary line; the status page
    # and /api/v1/events show them (with `kvobserve run` they are logged).
    logging.getLogger("kvobserve.health").setLevel(logging.ERROR)
    stop = stop_event()
    try:
        demo = await start_demo(
            http, rate=args.rate, interval_s=args.interval, seed=args.seed, dynamo=args.dynamo
        )
    except OSError as exc:
        return fail("demo", f"http.listen {http.listen}: {exc.strerror or exc}", 1)
    base = f"{'https' if http.tls else 'http'}://{http.listen}"
    dyn = (
        "\n  dynamo       a Dynamo worker (4 streams), a KV indexer losing removals"
        if args.dynamo
        else ""
    )
    print(
        f"kvobserve demo: 3 simulated engine nodes, 12 KV-event streams, 3 collectors{dyn}\n"
        f"  metrics      {base}/metrics\n"
        f"  status page  {base}/\n"
        f"  faults       SGLang ranks 2,5: batches lost on the wire (recovered by replay) and"
        f" publisher restarts; vLLM rank 1: a second publisher (duplicate stream)\n"
        f"Ctrl-C stops.",
        file=out,
        flush=True,
    )
    tty = out.isatty()
    deadline = time.monotonic() + args.duration if args.duration > 0 else None
    last: tuple[float, int] | None = None
    printed = 0.0
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
        line, last = summary_line(demo, last)
        if tty:
            print("\r\x1b[2K" + line, end="", file=out, flush=True)
        elif time.monotonic() - printed >= 5.0:  # logs: a line every 5 s, not a flood
            print(line, file=out, flush=True)
            printed = time.monotonic()
        if deadline is not None and time.monotonic() >= deadline:
            break
    if tty:
        print(file=out)
    await asyncio.wait_for(demo.close(), 1.9)
    if args.truth:
        write_truth(args.truth, demo.truth())
    return 0
