"""Shared helpers of the collector acceptance tests: configs, a running collector, truth, captures."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from kvobserve.collector import Collector
from kvobserve.config import Config, load_config
from kvobserve.simulate import SimConfig, SimulatedWorker
from kvobserve.sources.ingest_options import IngestOptions
from kvobserve.transport.local import LocalBus
from kvobserve.wire.snapshot import Snapshot, StreamStats
from tests.polling import until_async

CAPTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engine-captures"
CAPTURE_FOLDERS = sorted(p.name for p in CAPTURES.iterdir() if (p / "expected.json").is_file())
SIM_FORMATS = (
    "sglang-0.4",
    "sglang-0.5.12",
    "sglang-0.5.19",
    "sglang-0.5.23",
    "vllm-0.10",
    "vllm-0.23",
    "vllm-0.33",
    "vllm-0.33-bytes",
)
Resident = dict[str, set[Any]]  # medium -> block hashes


# --- configs ---------------------------------------------------------------------------------


def collector_config(
    engine: str,
    *,
    kv_endpoint: str | None = None,
    replay_endpoint: str | None = None,
    dp_size: int | None = None,
    worker_id: str | None = "w",
    collector_id: str = "c0",
    node_rank: int = 0,
    nnodes: int = 1,
    interval_s: float = 0.2,
    **worker: Any,
) -> Config:
    """A Config built the way flags build it (`load_config(None, overrides, {})`), one worker."""
    o: dict[str, Any] = {
        "collector.id": collector_id,
        "collector.node_rank": node_rank,
        "collector.nnodes": nnodes,
        "collector.interval_s": interval_s,
        "worker.engine": engine,
    }
    for key, value in (
        ("worker.id", worker_id),
        ("worker.kv_endpoint", kv_endpoint),
        ("worker.replay_endpoint", replay_endpoint),
        ("worker.dp_size", dp_size),
    ):
        if value is not None:
            o[key] = value
    if engine == "sglang":  # the SGLang default of multi-node DP deployments; None: unset
        worker.setdefault("dp_attention", True)
    o.update({f"worker.{k}": v for k, v in worker.items() if v is not None})
    return load_config(None, o, {})


def sim_collector_config(sim: SimulatedWorker, *, replay: bool = True, **kw: Any) -> Config:
    """A collector config watching every rank of a (single-node) simulated worker."""
    c = sim.cfg
    kw.setdefault("dp_size", c.dp_size)
    kw.setdefault("topic", c.topic or None)
    return collector_config(
        sim.fmt.engine,
        kv_endpoint=f"tcp://{c.host}:{sim.kv_base}",
        replay_endpoint=f"tcp://{c.host}:{sim.replay_base}"
        if replay and sim.replay_base is not None
        else None,
        **kw,
    )


# --- simulated workers -------------------------------------------------------------------------


def sim_config(fmt: str = "sglang-0.5.23", **kw: Any) -> SimConfig:
    """A fast, small simulated worker: 2 ranks, 1000 batches/s, no HTTP unless asked."""
    kw.setdefault("dp_size", 2)
    kw.setdefault("rate", 1000.0)
    kw.setdefault("max_batches", 60)
    kw.setdefault("start_delay_s", 0.5)  # SUBs connect first (ZMQ slow joiner)
    kw.setdefault("http_port", None)
    kw.setdefault("prompts", 40)
    return SimConfig(format=fmt, **kw)


@dataclass
class Sims:
    """Started simulated workers, all stopped at teardown."""

    started: list[SimulatedWorker] = field(default_factory=list)

    def start(self, cfg: SimConfig, *, held: bool = False) -> SimulatedWorker:
        """Start (and remember) one worker; `held`: it publishes once `wait_connected` saw the
        collector's streams up (SimulatedWorker.resume)."""
        w = SimulatedWorker(cfg).start(held=held)
        self.started.append(w)
        return w

    def stop_all(self) -> None:
        """Stop every started worker (idempotent)."""
        for w in self.started:
            w.stop()


def sim_finished(sim: SimulatedWorker) -> bool:
    """Every primary instance of every rank published its max_batches."""
    m = sim.cfg.max_batches
    return all(s.seq >= m for st in sim.ranks for s in st.streams)


def truth_instance(truth: dict[str, Any], rank: int, kind: str = "primary") -> dict[str, Any]:
    """The newest publisher instance of `kind` on `rank` in a truth document."""
    found = [i for i in truth["ranks"][str(rank)]["instances"] if i["kind"] == kind]
    return found[-1]


def truth_resident(instance: dict[str, Any]) -> Resident:
    """A truth instance's resident set, hashes as the decoder gives them (hex -> bytes)."""
    return normalized({m: {_hash(h) for h in hs} for m, hs in instance["resident"].items()})


def _hash(h: int | str) -> int | bytes:
    return bytes.fromhex(h) if isinstance(h, str) else h


def normalized(res: Resident) -> Resident:
    """Without empty media (a medium seen once stays in the index at 0 blocks)."""
    return {m: s for m, s in res.items() if s}


# --- a running collector -----------------------------------------------------------------------


@asynccontextmanager
async def running_collector(
    cfg: Config,
    *,
    ingest: IngestOptions | None = None,
    observers: list[Callable[[Snapshot], object]] | None = None,
    rediscovery_s: float = 30.0,
    pod_watch: dict[str, Any] | None = None,
) -> AsyncIterator[Collector]:
    """A started Collector on a LocalBus; closed (and the bus with it) on exit."""
    bus = LocalBus()
    col = Collector(
        cfg,
        bus,
        ingest=ingest,
        observers=observers,
        rediscovery_s=rediscovery_s,
        pod_watch=pod_watch,
    )
    try:
        await col.start()
        yield col
    finally:
        await col.close()
        await bus.close()


async def wait_snapshot(
    col: Collector, pred: Callable[[Snapshot], bool], timeout_s: float = 20.0, what: str = ""
) -> Snapshot:
    """Poll the collector's snapshot until `pred` holds; fail with the last one at the deadline."""
    last: list[Snapshot] = []

    async def check() -> Snapshot | None:
        snap = await col.snapshot()
        last[:] = [snap]
        return snap if pred(snap) else None

    return await until_async(
        check, timeout_s, what or getattr(pred, "__name__", "the snapshot"),
        lambda: describe(last[0]) if last else "no snapshot",
    )  # fmt: skip


def describe(snap: Snapshot) -> str:
    """One line per stream, for assertion messages."""
    lines = [
        f"{s.worker_id}/{s.dp_rank} up={s.up} batches={s.batches_total} gaps={s.gaps} "
        f"missed={s.missed} recovered={s.recovered} lost={s.lost} restarts={s.restarts} "
        f"replay={s.replay_requests} dup={s.duplicate_stream} errors={s.decode_errors} "
        f"complete={s.state_complete}"
        for s in snap.streams
    ]
    lines += [f"unexpected {u}" for u in snap.unexpected]
    return "\n".join(lines)


def stream(snap: Snapshot, rank: int, worker_id: str = "w") -> StreamStats:
    """The stream of `rank` in a snapshot."""
    for s in snap.streams:
        if s.worker_id == worker_id and s.dp_rank == rank:
            return s
    raise AssertionError(f"no stream {worker_id}/{rank} in\n{describe(snap)}")


def all_streams(pred: Callable[[StreamStats], bool]) -> Callable[[Snapshot], bool]:
    """A snapshot predicate: there are streams and `pred` holds for each."""
    return lambda snap: bool(snap.streams) and all(pred(s) for s in snap.streams)


async def wait_connected(col: Collector, sim: SimulatedWorker | None = None) -> Snapshot:
    """Every stream up; with `sim`, before it starts publishing (so no batch is missed): a
    worker started held publishes from now on; any other must not have begun yet."""
    snap = await wait_snapshot(col, all_streams(lambda s: s.up), what="streams up")
    if sim is not None and sim.held:
        sim.resume()
    elif sim is not None:
        left = sim.started_at + sim.cfg.start_delay_s - time.monotonic()
        assert left > 0, f"slow joiner: SUBs connected {-left:.2f} s after publishing began"
    return snap


async def resident(col: Collector, worker_id: str, rank: int) -> Resident:
    """The stream's resident block set, read in the ingest thread."""
    ingest = col.ingest
    assert ingest is not None

    def read() -> Resident:
        seq = ingest.sequencer(worker_id, rank)
        assert seq is not None, f"no sequencer for {worker_id}/{rank}"
        return seq.index.resident_hashes()

    return normalized(await asyncio.wrap_future(ingest.call(read)))


# --- engine captures ---------------------------------------------------------------------------


@dataclass
class Capture:
    """One capture folder: live frames and expected batches per rank."""

    name: str
    meta: dict[str, Any]
    live: dict[int, list[tuple[int, list[bytes]]]]  # rank -> [(seq, frames)] in publish order
    expected: dict[int, list[dict[str, Any]]]  # rank -> batches in publish order

    @property
    def engine(self) -> str:
        """sglang or vllm."""
        return str(self.meta["engine"])

    @property
    def topic(self) -> str:
        """The topic the publishers used."""
        return str(self.meta["topic"])


def load_capture(name: str) -> Capture:
    """Read frames.jsonl (live lines only) and expected.json of one capture folder."""
    folder = CAPTURES / name
    meta = json.loads((folder / "meta.json").read_text())
    live: dict[int, list[tuple[int, list[bytes]]]] = {}
    for line in (folder / "frames.jsonl").read_text().splitlines():
        m = json.loads(line)
        if m["source"] != "live":
            continue
        frames = [base64.b64decode(f) for f in m["frames"]]
        live.setdefault(m["dp_rank"], []).append((int.from_bytes(frames[1], "big"), frames))
    expected: dict[int, list[dict[str, Any]]] = {}
    for b in json.loads((folder / "expected.json").read_text()):
        expected.setdefault(b["dp_rank"], []).append(b)
    return Capture(name, meta, live, expected)


def expected_resident(batches: Iterable[dict[str, Any]]) -> Resident:
    """The resident set after `batches`, computed from expected.json alone (not BlockIndex)."""
    res: Resident = {}
    for b in batches:
        for ev in b["events"]:
            medium = ev.get("medium") or "GPU"  # versions without medium: the GPU tier
            if ev["type"] == "BlockStored":
                res.setdefault(medium, set()).update(_hash(h) for h in ev["block_hashes"])
            elif ev["type"] == "BlockRemoved":
                res.setdefault(medium, set()).difference_update(
                    _hash(h) for h in ev["block_hashes"]
                )
            elif ev["type"] == "AllBlocksCleared":
                for s in res.values():
                    s.clear()
    return normalized(res)


def expected_event_counts(batches: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Events per type as kvobserve_kv_events_total counts them."""
    names = {"BlockStored": "stored", "BlockRemoved": "removed", "AllBlocksCleared": "cleared"}
    out = dict.fromkeys(names.values(), 0)
    for b in batches:
        for ev in b["events"]:
            out[names[ev["type"]]] += 1
    return out


class CapturePublisher:
    """One XPUB per rank on `base + rank`: sends live frames once that rank's SUB subscribed.

    XPUB puts the same bytes on the wire as the engines' PUB, and it tells us when the
    subscription arrived, so nothing is sent before the collector listens (no sleep needed).
    """

    def __init__(self, ranks: Iterable[int], host: str = "127.0.0.1") -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.ranks = sorted(ranks)
        self.host = host
        self.socks: dict[int, zmq.Socket[bytes]] = {}
        self.subscribed: set[int] = set()
        self.base = self._bind()

    def _bind(self) -> int:
        rng = random.Random()
        for _ in range(50):
            base = rng.randrange(20000, 60000)
            socks: dict[int, zmq.Socket[bytes]] = {}
            try:
                for r in self.ranks:
                    s = self.ctx.socket(zmq.XPUB)
                    socks[r] = s
                    s.setsockopt(zmq.LINGER, 0)
                    s.bind(f"tcp://{self.host}:{base + r}")
            except zmq.ZMQError:
                for s in socks.values():
                    s.close(0)
                continue
            self.socks = socks
            return base
        raise OSError("no free port range for the capture publishers")

    @property
    def endpoint(self) -> str:
        """Rank 0's endpoint (the base)."""
        return f"tcp://{self.host}:{self.base}"

    async def wait_subscribed(self, timeout_s: float = 10.0) -> None:
        """Until every rank's XPUB got a subscribe message."""
        end = time.monotonic() + timeout_s
        while len(self.subscribed) < len(self.ranks):
            for r, s in self.socks.items():
                while s.poll(0):
                    if s.recv()[:1] == b"\x01":
                        self.subscribed.add(r)
            if time.monotonic() > end:
                raise AssertionError(f"ranks {set(self.ranks) - self.subscribed} never subscribed")
            await asyncio.sleep(0.01)  # polling interval, not synchronization

    def send(self, rank: int, frames: list[bytes]) -> None:
        """One live message on the rank's socket."""
        self.socks[rank].send_multipart(frames)

    def close(self) -> None:
        """Close every socket (linger 0)."""
        self.ctx.destroy(linger=0)


@contextmanager
def capture_publisher(ranks: Iterable[int]) -> Iterator[CapturePublisher]:
    """A CapturePublisher closed on exit."""
    pub = CapturePublisher(ranks)
    try:
        yield pub
    finally:
        pub.close()
