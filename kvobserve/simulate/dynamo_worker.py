"""A simulated Dynamo worker node: its ranks' engines relayed onto Dynamo's event plane.

Each hosted rank runs an engine (SimStream) behind a DynamoPublisher (dynamo_relay.py); the
messages go to a NATS server (core NATS, endpoint-scoped subjects) or out of ZMQ direct PUBs bound
on this node's own address, one per publisher, plus one PUB for `kv_metrics` and
`forward-pass-metrics`. ActiveLoad and ForwardPassMetrics are sent per rank every
`side_interval_s`. Faults: `drop_event_ids` (the message carrying such an id is lost),
`restart_every` (a new publisher: new publisher_id, event_id back to 1, sequence back to 0, an
empty cache; on ZMQ the same socket goes on), `second_publisher` (a second publisher of its own
for the same (worker_id, dp_rank)). One thread runs an asyncio loop for the whole node.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
import threading
import time
import zlib
from typing import Any

import nats
import zmq

from kvobserve.simulate import dynamo_encode as enc
from kvobserve.simulate.cache import PromptLibrary
from kvobserve.simulate.config import SimConfig
from kvobserve.simulate.dynamo_indexer import SimIndexer
from kvobserve.simulate.dynamo_relay import DynamoPublisher
from kvobserve.simulate.faults import FaultConfig
from kvobserve.simulate.ranks import Endpoint
from kvobserve.simulate.stream import SimStream
from kvobserve.simulate.truth import TRUTH_VERSION, write_truth

log = logging.getLogger(__name__)


def dynamo_worker_id(cfg: SimConfig) -> int:
    """The Dynamo worker (instance) id: configured, else derived from seed and worker id."""
    if cfg.dynamo_worker_id:
        return cfg.dynamo_worker_id
    digest = hashlib.sha256(f"{cfg.seed}/{cfg.worker_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class DynamoRank:
    """One hosted rank: its publishers (primary, maybe a second) and the restarted ones."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.publishers: list[DynamoPublisher] = []
        self.past: list[DynamoPublisher] = []
        self.socks: list[Any] = []  # ZMQ: one PUB per publisher, in `publishers` order
        self.endpoints: list[str] = []
        self.restarts = 0


class SimulatedDynamoWorker:
    """One simulated Dynamo worker node; `start()`, `endpoints()`, `truth()`, `stop()`."""

    def __init__(self, cfg: SimConfig, indexer: SimIndexer | None = None) -> None:
        self.cfg = cfg.validate()
        assert cfg.event_plane is not None, "SimulatedDynamoWorker needs event_plane"
        self.fmt = cfg.wire
        self.worker_id = dynamo_worker_id(cfg)
        self._library = PromptLibrary(
            cfg.seed, self.fmt.hash_kind, cfg.page_size, cfg.prompts, cfg.prefixes, cfg.zipf_s
        )
        pids = f"{cfg.seed}/{cfg.worker_id}/{cfg.node_rank}/pids"
        self._rng = random.Random(zlib.crc32(pids.encode()))
        self.ranks = [DynamoRank(r) for r in cfg.hosted_ranks()]
        self.indexer = indexer
        self.own_indexer = False
        self.lock = threading.Lock()
        self._ctx: zmq.Context[Any] | None = None
        self._metrics_sock: Any = None
        self.metrics_endpoint = ""
        self._nc: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._go = threading.Event()
        self._error: BaseException | None = None
        self.side_sent = 0  # side-channel rounds
        self.side_seq = [0, 0]  # envelope sequences of the kv_metrics and FPM publishers

    # --- setup --------------------------------------------------------------------------------

    def _publisher(self, st: DynamoRank, kind: str) -> DynamoPublisher:
        c = self.cfg
        instance = f"{st.rank}.{st.restarts}" if kind == "primary" else f"{st.rank}.{kind}"
        seed = zlib.crc32(f"{c.seed}/{c.worker_id}/{instance}".encode())
        stream = SimStream(
            self.fmt, instance, kind, st.rank, st.rank, b"", self._library, seed,
            c.capacity_tokens, c.page_size, c.buffer_steps, FaultConfig(), c.requests_per_batch,
            c.output_tokens, c.flush_every, c.max_running_requests,
        )  # fmt: skip
        return DynamoPublisher(stream, self.worker_id, st.rank, c.page_size, self._rng)

    def _bind(self) -> Any:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.cfg.hwm)
        port = sock.bind_to_random_port(f"tcp://{self.cfg.host}")
        return sock, f"tcp://{self.cfg.host}:{port}"

    def start(self) -> SimulatedDynamoWorker:
        """Create the publishers, bind or connect, start the thread (and the indexer, if any)."""
        c = self.cfg
        for st in self.ranks:
            st.publishers.append(self._publisher(st, "primary"))
            if st.rank in c.faults.second_publisher:
                st.publishers.append(self._publisher(st, "second"))
        if c.indexer_port is not None and self.indexer is None:
            miss = c.indexer_miss_worker in ("", c.worker_id) and c.indexer_mode == "miss_worker"
            self.indexer = SimIndexer(
                c.indexer_mode,
                c.indexer_lag_events,
                self.worker_id if miss else None,
                c.page_size,
                c.model_name,
            )
            self.own_indexer = True
        if self.own_indexer and self.indexer is not None:
            self.indexer.start(c.host, c.indexer_port or 0)
        self._thread = threading.Thread(
            target=self._run, name=f"sim-dyn-{c.worker_id}", daemon=True
        )
        self._thread.start()
        self._ready.wait(10.0)
        if self._error is not None:
            self.stop()
            raise OSError(f"event_plane: {self._error}")
        return self

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception:
            log.exception("simulated Dynamo worker %s failed", self.cfg.worker_id)

    async def _setup(self) -> None:
        if self.cfg.event_plane == "nats":
            self._nc = await nats.connect(self.cfg.event_plane_url or "", connect_timeout=5)
            return
        self._ctx = zmq.Context()
        for st in self.ranks:
            for _ in st.publishers:
                sock, ep = self._bind()
                st.socks.append(sock)
                st.endpoints.append(ep)
        self._metrics_sock, self.metrics_endpoint = self._bind()

    async def _main(self) -> None:
        try:
            await self._setup()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            await self._close()
            return
        self._ready.set()
        c = self.cfg
        interval = 1.0 / c.rate if c.rate > 0 else 0.0
        next_due = time.monotonic() + c.start_delay_s
        next_side = time.monotonic()  # load beats from the start, as a worker's do
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if self._go.is_set():
                    self._go.clear()
                    next_due = min(next_due, now)
                out: list[tuple[str, list[bytes]]] = []
                with self.lock:
                    bursts = 0
                    while now >= next_due and bursts < 64 and not self._finished():
                        self._tick(out)
                        next_due += interval
                        bursts += 1
                    if now - next_due > 1.0:
                        next_due = now
                    if now >= next_side:
                        self._side(out)
                        next_side = now + c.side_interval_s
                await self._send(out)
                await asyncio.sleep(min(max(next_due - time.monotonic(), 0.0), 0.05) or 0.001)
        finally:
            await self._close()

    # --- publishing ---------------------------------------------------------------------------

    def _finished(self) -> bool:
        m = self.cfg.max_batches
        return bool(m) and all(p.stream.seq >= m for st in self.ranks for p in st.publishers)

    def _subject(self, topic: str) -> str:
        c = self.cfg
        return enc.subject(c.namespace, c.component, c.endpoint, topic)

    def _tick(self, out: list[tuple[str, list[bytes]]]) -> None:
        c, f = self.cfg, self.cfg.faults
        now_ms = int(time.time() * 1000)
        subject = self._subject(enc.KV_EVENTS)
        for st in self.ranks:
            for i, pub in enumerate(st.publishers):
                if c.max_batches and pub.stream.seq >= c.max_batches:
                    continue
                # seq-based faults hit the first instance only, unless they repeat (`period`)
                hit = pub.stream.kind == "primary" and f.applies(st.rank)
                hit = hit and (bool(f.period) or st.restarts == 0)
                drop = f.drop_event_ids if hit else frozenset()
                for seq, body, events, delivered in pub.step(now_ms, drop):
                    if not delivered:
                        continue
                    if self.indexer is not None:
                        with self.indexer.lock:
                            self.indexer.feed(events)
                    if c.event_plane == "nats":
                        out.append((subject, [body]))
                    else:
                        frames = enc.zmq_frames(enc.KV_EVENTS, pub.publisher_id, seq, body)
                        out.append((st.endpoints[i], frames))
            primary = st.publishers[0]
            again = bool(f.period) or st.restarts == 0  # once, unless the faults repeat
            if (
                f.restart_every
                and again
                and f.applies(st.rank)
                and primary.stream.seq >= f.restart_every
            ):
                primary.ended = True
                st.past.append(primary)
                st.restarts += 1
                st.publishers[0] = self._publisher(st, "primary")

    def _side(self, out: list[tuple[str, list[bytes]]]) -> None:
        """One ActiveLoad and one ForwardPassMetrics per hosted rank."""
        c = self.cfg
        for st in self.ranks:
            s = st.publishers[0].stream
            blocks = s.held_tokens // c.page_size
            load = enc.active_load(self.worker_id, st.rank, blocks, None, blocks)
            fpm = enc.forward_pass_metrics(
                str(self.worker_id), st.rank, self.side_sent, time.time(),
                (0, 0, 0.0, 0, s.running, s.held_tokens, 0.0), (0, 0, 0.0, s.waiting, 0, 0.0),
            )  # fmt: skip
            now_ms = int(time.time() * 1000)
            for i, (topic, payload) in enumerate(
                ((enc.KV_METRICS, load), (enc.FORWARD_PASS_METRICS, fpm))
            ):
                pid, seq = (self.worker_id >> 11) ^ (i + 1), self.side_seq[i]
                body = enc.envelope(topic, pid, seq, now_ms, payload)
                if c.event_plane == "nats":
                    out.append((self._subject(topic), [body]))
                else:
                    out.append((self.metrics_endpoint, enc.zmq_frames(topic, pid, seq, body)))
                self.side_seq[i] += 1
        self.side_sent += 1

    async def _send(self, out: list[tuple[str, list[bytes]]]) -> None:
        if not out:
            return
        if self._nc is not None:
            for subject, (body,) in out:
                await self._nc.publish(subject, body)
            return
        socks = {ep: s for st in self.ranks for ep, s in zip(st.endpoints, st.socks, strict=True)}
        socks[self.metrics_endpoint] = self._metrics_sock
        for ep, frames in out:
            # past the HWM a message is dropped, as Dynamo's non-blocking PUB does
            with contextlib.suppress(zmq.Again):
                socks[ep].send_multipart(frames, zmq.NOBLOCK)

    async def _close(self) -> None:
        nc, self._nc = self._nc, None
        if nc is not None:
            try:
                await nc.flush(timeout=2)
            finally:
                await nc.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    # --- public -------------------------------------------------------------------------------

    def publish_now(self) -> None:
        """End the start delay now (a test's subscribers are known to be listening)."""
        self._go.set()

    def endpoints(self) -> list[Endpoint]:
        """What this node serves or publishes to."""
        w, c = self.cfg.worker_id, self.cfg
        out: list[Endpoint] = []
        if c.event_plane == "nats":
            out.append(Endpoint(w, "dynamo_nats", None, c.event_plane_url or ""))
        for st in self.ranks:
            out += [Endpoint(w, "dynamo_kv", st.rank, ep) for ep in st.endpoints]
        if self.metrics_endpoint:
            out.append(Endpoint(w, "dynamo_metrics", None, self.metrics_endpoint))
        if self.own_indexer and self.indexer is not None:
            out.append(Endpoint(w, "indexer", None, f"http://{c.host}:{self.indexer.port}"))
        return out

    def truth(self) -> dict[str, Any]:
        """The ground truth now (consistent: taken between two ticks)."""
        with self.lock:
            return build_dynamo_truth(self)

    def stop(self, timeout: float = 2.0) -> None:
        """Stop publishing, write the truth file, close everything; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self.own_indexer and self.indexer is not None:
            self.indexer.stop()
        if self.cfg.truth_path:
            write_truth(self.cfg.truth_path, build_dynamo_truth(self))

    def __enter__(self) -> SimulatedDynamoWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def build_dynamo_truth(w: SimulatedDynamoWorker) -> dict[str, Any]:
    """The truth document of one Dynamo worker node."""
    c = w.cfg
    doc: dict[str, Any] = {
        "truth_version": TRUTH_VERSION,
        "worker_id": c.worker_id,
        "mode": "dynamo",
        "event_plane": c.event_plane,
        "dynamo_worker_id": w.worker_id,
        "format": c.format,
        "node_rank": c.node_rank,
        "nnodes": c.nnodes,
        "dp_size": c.dp_size,
        "page_size": c.page_size,
        "ranks": {
            str(st.rank): {
                "restarts": st.restarts,
                "endpoints": list(st.endpoints),
                "publishers": [p.truth() for p in (*st.past, *st.publishers)],
            }
            for st in w.ranks
        },
    }
    if w.own_indexer and w.indexer is not None:
        doc["indexer"] = indexer_truth(w.indexer, [w])
    return doc


def indexer_truth(indexer: SimIndexer, workers: list[SimulatedDynamoWorker]) -> dict[str, Any]:
    """What the simulated indexer holds against what the primary publishers delivered."""
    truth: dict[tuple[int, int, str], set[int]] = {}
    for w in workers:
        for st in w.ranks:
            for tier, blocks in st.publishers[0].delivered.items():
                truth[(w.worker_id, st.rank, tier)] = set(blocks)
    with indexer.lock:
        streams = indexer.injected(truth)
    return {"mode": indexer.mode, "port": indexer.port, "streams": streams}
