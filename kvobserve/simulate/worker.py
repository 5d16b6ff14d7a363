"""A simulated engine node: per-rank PUB + replay ROUTER, side channels, faults, in one thread.

All ZMQ sockets of a worker are owned by one background thread (ZMQ sockets are not thread-safe);
`start()` binds them first, so the ports are known when it returns. `stop()` ends within 2 s.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import zmq

from kvobserve.simulate import ports
from kvobserve.simulate.cache import PromptLibrary
from kvobserve.simulate.config import SimConfig
from kvobserve.simulate.encoders import replay_end, replay_frames
from kvobserve.simulate.ranks import Endpoint, RankState
from kvobserve.simulate.sidechannels import emit_side_channels
from kvobserve.simulate.stream import SimStream
from kvobserve.simulate.truth import build_truth, write_truth

log = logging.getLogger(__name__)


class SimulatedWorker:
    """One simulated engine node; `start()`, `endpoints()`, `truth()`, `stop()`."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg.validate()
        self.fmt = cfg.wire
        self._topic = cfg.topic.encode()
        self._library = PromptLibrary(
            cfg.seed, self.fmt.hash_kind, cfg.page_size, cfg.prompts, cfg.prefixes, cfg.zipf_s
        )
        self.ranks: list[RankState] = []
        self.stray: RankState | None = None
        self.bind_failures: list[str] = []
        self.kv_base = cfg.kv_port
        self.replay_base = cfg.replay_port
        self.load_base = cfg.load_port
        self.http_port: int | None = None
        # the other nodes of this worker in this process (SimulatorGroup links them): a vLLM
        # head's API server reads their ranks, as the real one hears from every engine core
        self.peers: list[SimulatedWorker] = []
        self._ctx: zmq.Context[Any] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._http: Any = None
        self._sockets_changed = False
        self.started_at = 0.0
        self.held = False  # started held: publishing waits for resume()

    # --- setup --------------------------------------------------------------------------------

    def _new_stream(self, st: RankState, kind: str, label: int) -> SimStream:
        c = self.cfg
        instance = f"{st.rank}.{st.restarts}" if kind == "primary" else f"{st.rank}.{kind}"
        # crc32, not hash(): str hashes differ between processes and --seed must reproduce a run
        seed = zlib.crc32(f"{c.seed}/{c.worker_id}/{instance}".encode())
        stream = SimStream(
            self.fmt, instance, kind, st.rank, label, self._topic, self._library, seed,
            c.capacity_tokens, c.page_size, c.buffer_steps, c.faults, c.requests_per_batch,
            c.output_tokens, c.flush_every, c.max_running_requests, c.cpu_tier_tokens,
        )  # fmt: skip
        if c.trace is not None:  # its requests come from the trace replay (replay_driver.py)
            stream.outbox = []
        return stream

    def _bind_group(
        self, base: int, offsets: list[int], kind: int, setup: Callable[[Any], None]
    ) -> tuple[int, list[zmq.Socket[Any]]]:
        """Bind one socket per offset at base + offset. Base 0: one socket binds port 0 and
        reads it back; several try ranges of the port block (ports.py)."""
        assert self._ctx is not None
        if base == 0 and offsets == [0]:
            s = self._ctx.socket(kind)
            s.setsockopt(zmq.LINGER, 0)
            setup(s)
            s.bind(f"tcp://{self.cfg.host}:0")
            port = int(s.getsockopt_string(zmq.LAST_ENDPOINT).rpartition(":")[2])
            ports.remember([port])
            return port, [s]
        last: Exception | None = None
        span = max(offsets, default=0) + 1
        for _ in range(100 if base == 0 else 1):
            b = base or ports.candidate_base(span)
            if b is None:
                continue
            socks: list[zmq.Socket[Any]] = []
            try:
                for off in offsets:
                    s = self._ctx.socket(kind)
                    socks.append(s)
                    s.setsockopt(zmq.LINGER, 0)
                    setup(s)
                    s.bind(f"tcp://{self.cfg.host}:{b + off}")
                ports.remember(range(b, b + span))
                return b, socks
            except zmq.ZMQError as exc:
                last = exc
                for s in socks:
                    s.close(0)
        raise OSError(f"kv_port/replay_port: cannot bind {len(offsets)} ports from {base}: {last}")

    def start(self, held: bool = False) -> SimulatedWorker:
        """Bind every socket, start the publisher thread and the HTTP server. `held`: publish
        nothing until `resume()` (an observer connects first, whatever the machine's load)."""
        self._ctx = zmq.Context()
        try:
            self._setup()
        except BaseException:
            self._ctx.destroy(linger=0)
            self._ctx = None
            raise
        self.held = held
        if held:
            self.pause()
        self.started_at = time.monotonic()
        self._thread = threading.Thread(
            target=self._run, name=f"sim-{self.cfg.worker_id}", daemon=True
        )
        self._thread.start()
        return self

    def _setup(self) -> None:
        c = self.cfg
        assert self._ctx is not None
        hosted = c.hosted_ranks()
        offsets: dict[int, int] = {}
        for r in hosted:
            off = c.port_offset(r)
            if off in offsets.values():
                # what the engine does: the scheduler crashes with "Address already in use"
                self.bind_failures.append(f"dp_rank {r}: port offset {off} already bound")
                continue
            offsets[r] = off
        stray = c.faults.stray_publisher and (c.dp_size - 1 in hosted)
        pub_offsets = list(offsets.values()) + ([c.dp_size] if stray else [])
        if c.kv_connect is not None:  # vLLM with a concrete host, llm-d's central mode
            self.kv_base = int(c.kv_connect.rpartition(":")[2])
            pubs = [self._connect_pub(self.kv_base + off) for off in pub_offsets]
        else:
            self.kv_base, pubs = self._bind_group(
                c.kv_port, pub_offsets, zmq.PUB, lambda s: s.setsockopt(zmq.SNDHWM, c.hwm)
            )
        routers: list[zmq.Socket[Any]] = []
        if c.replay_port is not None:
            # vLLM 0.33 sets SNDHWM 2*(buffer_steps+1) so a full replay is never cut short
            hwm = 2 * (c.buffer_steps + 1)
            self.replay_base, routers = self._bind_group(
                c.replay_port, list(offsets.values()), zmq.ROUTER,
                lambda s: s.setsockopt(zmq.SNDHWM, hwm),
            )  # fmt: skip
        loads: list[zmq.Socket[Any]] = []
        if c.load_port is not None:
            self.load_base, loads = self._bind_group(
                c.load_port, list(offsets.values()), zmq.PUB, lambda s: s.setsockopt(zmq.SNDHWM, 8)
            )
        mirror_src = dict((dst, src) for src, dst in c.faults.mirror)
        for i, (r, off) in enumerate(offsets.items()):
            st = RankState(
                r, self.kv_base + off, (self.replay_base or 0) + off if routers else None
            )
            st.pub = pubs[i]
            st.router = routers[i] if routers else None
            st.load = loads[i] if loads else None
            st.mirror_of = mirror_src.get(r)
            st.stall_at = c.faults.stall_after or math.inf
            label = c.faults.label_for(r)
            st.streams.append(self._new_stream(st, "primary", label))
            if r in c.faults.second_publisher:
                st.streams.append(self._new_stream(st, "second", label))
            if c.kv_metrics_endpoint:
                st.push = self._ctx.socket(zmq.PUSH)
                st.push.setsockopt(zmq.LINGER, 0)
                st.push.connect(c.kv_metrics_endpoint)
            self.ranks.append(st)
        by_rank = {st.rank: st for st in self.ranks}
        for st in self.ranks:
            if st.mirror_of is not None and st.mirror_of in by_rank:
                by_rank[st.mirror_of].mirrors.append(st)
        if stray:
            self.stray = RankState(c.dp_size, self.kv_base + c.dp_size, None)
            self.stray.pub = pubs[-1]
            self.stray.streams.append(self._new_stream(self.stray, "stray", c.dp_size))
        if c.http_role is not None and c.http_port is not None:
            from kvobserve.simulate.http import SimHttpServer

            self._http = SimHttpServer(self, c.host, c.http_port)
            self.http_port = self._http.start()

    # --- the loop -----------------------------------------------------------------------------

    def _run(self) -> None:
        c = self.cfg
        interval = 1.0 / c.rate if c.rate > 0 else 0.0
        poller, routers = self._poller()
        next_due = time.monotonic() + c.start_delay_s
        next_side = next_due
        next_truth = next_due + c.truth_interval_s
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                with self._lock:
                    bursts = 0
                    while now >= next_due and bursts < 256 and not self._stop.is_set():
                        self._tick(now)
                        next_due += interval
                        bursts += 1
                    if now - next_due > 1.0:
                        next_due = now  # far behind: do not burst to catch up forever
                    if now >= next_side:
                        emit_side_channels(self)
                        next_side = now + c.side_interval_s
                    if c.truth_path and c.truth_interval_s > 0 and now >= next_truth:
                        write_truth(c.truth_path, build_truth(self))
                        next_truth = now + c.truth_interval_s
                wait = min(max(next_due - time.monotonic(), 0.0), 0.05)
                if self._finished():
                    wait = 0.05
                if self._sockets_changed:  # a restart replaced ROUTER sockets
                    poller, routers = self._poller()
                if routers:
                    for sock, _ in poller.poll(math.ceil(wait * 1000)):
                        with self._lock:
                            self._serve_replay(routers[sock])
                elif wait:
                    self._stop.wait(wait)
        except Exception:  # the loop must not die silently: report and stop publishing
            if self._stop.is_set():
                return  # stop() closed the sockets under a late tick: nothing failed
            log.exception("simulated worker %s failed", c.worker_id)

    def _poller(self) -> tuple[zmq.Poller, dict[Any, RankState]]:
        self._sockets_changed = False
        poller = zmq.Poller()
        routers = {st.router: st for st in self.ranks if st.router is not None}
        for sock in routers:
            poller.register(sock, zmq.POLLIN)
        return poller, routers

    def _finished(self) -> bool:
        m = self.cfg.max_batches
        return bool(m) and all(s.seq >= m for st in self.ranks for s in st.streams)

    def _tick(self, now: float) -> None:
        ts = time.time()
        for st in self.ranks:
            if st.mirror_of is None and now >= st.paused_until:
                self._publish_rank(st, now, ts)
        if self.stray is not None:
            self._publish_rank(self.stray, now, ts)

    def _publish_rank(self, st: RankState, now: float, ts: float) -> None:
        c = self.cfg
        peers = [o.streams[0] for o in self.ranks if o is not st and o.streams]
        for stream in st.streams:
            if c.max_batches and stream.seq >= c.max_batches:
                continue
            if stream.kind == "primary":
                stream.peers = peers
            out = stream.next_batch(ts)
            if out is None:
                continue
            frames = (self._topic, out[0], out[1])
            assert st.pub is not None
            st.pub.send_multipart(frames, copy=False)
            if stream.kind == "primary":
                for m in st.mirrors:
                    assert m.pub is not None
                    m.pub.send_multipart(frames, copy=False)
                    m.mirror_ring.append((stream.seq - 1, out[0], out[1]))
        primary = st.streams[0]
        f = c.faults
        if primary.kind != "primary" or not f.applies(st.rank):
            return
        if primary.seq >= st.stall_at:
            st.stall_at = st.stall_at + f.period if f.period else math.inf
            st.paused_until = now + f.stall_s
        if f.restart_every and primary.seq >= f.restart_every:
            self._restart(st, now)

    def _restart(self, st: RankState, now: float) -> None:
        """A new engine process: new sockets on the same ports, seq from 0, empty cache and ring."""
        old = st.streams[0]
        old.ended = True
        st.past.append(old)
        st.restarts += 1
        st.streams[0] = self._new_stream(st, "primary", old.label)
        f = self.cfg.faults
        if f.period and f.stall_after:
            st.stall_at = f.stall_after  # seq starts again at 0: so does the stall schedule
        for attr, port in (("pub", st.port), ("router", st.replay_port)):
            sock = getattr(st, attr)
            if sock is None or port is None:
                continue
            sock.close(0)
            if attr == "pub" and self.cfg.kv_connect is not None:
                new = self._connect_pub(port)  # a new process connects anew
            else:
                new = self._rebind(zmq.PUB if attr == "pub" else zmq.ROUTER, port)
            setattr(st, attr, new)
        st.paused_until = now + self.cfg.faults.restart_pause_s
        self._sockets_changed = True

    def kv_url(self, port: int) -> str:
        """Where the KV PUB of `port` is: bound on this node, or the endpoint it connects to."""
        c = self.cfg
        if c.kv_connect is not None:
            return f"{c.kv_connect.rpartition(':')[0]}:{port}"
        return f"tcp://{c.host}:{port}"

    def _connect_pub(self, port: int) -> zmq.Socket[Any]:
        """A KV PUB that connects to kv_connect's host at `port`, from this node's address."""
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.cfg.hwm)
        target = self.kv_url(port).removeprefix("tcp://")
        sock.connect(f"tcp://{self.cfg.host}:0;{target}")  # source address: a pod's own IP
        return sock

    def _rebind(self, kind: int, port: int) -> zmq.Socket[Any]:
        assert self._ctx is not None
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.PUB:
            sock.setsockopt(zmq.SNDHWM, self.cfg.hwm)
        else:
            sock.setsockopt(zmq.SNDHWM, 2 * (self.cfg.buffer_steps + 1))
        for _ in range(100):  # the closed socket releases the port asynchronously
            try:
                sock.bind(f"tcp://{self.cfg.host}:{port}")
                return sock
            except zmq.ZMQError:
                self._stop.wait(0.01)
        raise OSError(f"restart: port {port} did not become free")

    def _serve_replay(self, st: RankState) -> None:
        """Answer queued replay requests `[id, "", start_seq]` with every ring batch >= start."""
        router = st.router
        if router is None:
            return
        fmt = self.fmt
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                continue  # the engines log and ignore malformed requests
            ident = frames[0]
            start = int.from_bytes(frames[2], "big")
            st.replay_requests += 1
            for seq, seq_b, payload in list(st.ring):
                if seq >= start:
                    router.send_multipart([ident, *replay_frames(fmt, self._topic, seq_b, payload)])
                    st.replay_batches += 1
            router.send_multipart([ident, *replay_end(fmt)])

    # --- public -------------------------------------------------------------------------------

    def endpoints(self) -> list[Endpoint]:
        """Everything this node serves, in a stable order."""
        h, w = self.cfg.host, self.cfg.worker_id
        out: list[Endpoint] = []
        for st in self.ranks:
            out.append(Endpoint(w, "kv", st.rank, self.kv_url(st.port)))
            if st.replay_port is not None:
                out.append(Endpoint(w, "replay", st.rank, f"tcp://{h}:{st.replay_port}"))
            if st.load is not None and self.load_base is not None:
                out.append(
                    Endpoint(
                        w, "load", st.rank, f"tcp://{h}:{self.load_base + st.port - self.kv_base}"
                    )
                )
        if self.cfg.kv_metrics_endpoint:
            out.append(Endpoint(w, "kv_metrics", None, self.cfg.kv_metrics_endpoint))
        if self.stray is not None:
            out.append(Endpoint(w, "stray", self.stray.rank, self.kv_url(self.stray.port)))
        if self.http_port is not None:
            out.append(Endpoint(w, "http", None, f"http://{h}:{self.http_port}"))
        out.extend(
            Endpoint(w, "bind_failed", None, msg.replace(" ", "_")) for msg in self.bind_failures
        )
        return out

    def rank(self, dp_rank: int) -> RankState:
        """The hosted rank's state (KeyError if this node does not host it)."""
        for st in self.ranks:
            if st.rank == dp_rank:
                return st
        raise KeyError(dp_rank)

    @property
    def lock(self) -> threading.Lock:
        """Held while the publisher thread changes the ranks' state (a trace replay takes it)."""
        return self._lock

    def truth(self) -> dict[str, Any]:
        """The ground truth now (consistent: taken between two batches)."""
        with self._lock:
            return build_truth(self)

    def pause(self) -> None:
        """Hold every rank between two batches until `resume` (what it sent has left its PUB)."""
        with self._lock:
            for st in self.ranks:
                st.paused_until = math.inf

    def resume(self) -> None:
        """End every rank's stall now (a test holds a long stall until its observer joined)."""
        with self._lock:
            for st in self.ranks:
                st.paused_until = 0.0

    def stop(self, timeout: float = 2.0) -> None:
        """Stop publishing, write the truth file, close every socket with linger 0; idempotent."""
        if self._ctx is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._http is not None:
            self._http.stop()
            self._http = None
        if self.cfg.truth_path:
            write_truth(self.cfg.truth_path, build_truth(self))
        self._ctx.destroy(linger=0)
        self._ctx = None

    def __enter__(self) -> SimulatedWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
