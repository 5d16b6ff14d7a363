"""Dynamo event-plane ingest: NATS subscriptions or ZMQ direct SUBs, in a thread of its own.

One thread runs its own asyncio loop with every plane of the collector (a nats-py connection, or
one zmq.asyncio SUB per endpoint) and the DynamoTable that owns the streams, so the hot path takes
no locks and does not compete with the collector's HTTP loop for turns. Other threads talk to it
through `call()`, which runs a function in that loop and returns a Future. Dynamo's NATS server
is usually not kvobserve's own: each plane connects with its own `event_plane_*` settings.
Connection failures are retried with backoff and counted (`connection`); nothing here raises.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvobserve.sources.dynamo_plan import DynamoPlan
from kvobserve.sources.dynamo_state import DynamoOptions, DynamoStats
from kvobserve.sources.dynamo_streams import DynamoTable
from kvobserve.wire.kv_events import BlockHash
from kvobserve.wire.overlap import RankOverlap

if TYPE_CHECKING:  # nats-py is imported only when a NATS plane runs (`run` without NATS)
    from nats.aio.client import Client
    from nats.aio.msg import Msg

log = logging.getLogger(__name__)
_YIELD_EVERY = 64  # ZMQ messages handled before other tasks (stats, monitors) get a turn
T = TypeVar("T")
_EXPIRE_EVERY_S = 5.0


def _tls(w: Any) -> ssl.SSLContext | None:
    """The client TLS context of a plane's settings (None: plain, or nats-py's default for tls://)."""
    ca, cert, key = w.event_plane_tls_ca, w.event_plane_tls_cert, w.event_plane_tls_key
    if not (ca or cert):
        return None
    ctx = ssl.create_default_context(cafile=ca)
    if cert and key:
        ctx.load_cert_chain(cert, key)
    return ctx


class _NatsPlane:
    """Core-NATS subscriptions of one plane."""

    def __init__(self, index: int, plan: DynamoPlan, table: DynamoTable) -> None:
        self.index, self.plan, self.table = index, plan, table
        self.nc: Client | None = None
        self._state = table.planes[index]

    async def run(self) -> None:
        """Connect (retrying), subscribe; nats-py reconnects by itself after that."""
        import nats

        w = self.plan.worker
        servers = [u.strip() for u in self.plan.url.split(",")]
        kw: dict[str, Any] = {
            "servers": servers,
            "name": f"kvobserve-dynamo-{w.id}",
            "connect_timeout": 5,
            "allow_reconnect": True,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 1,
            "error_cb": self._on_error,
            "disconnected_cb": self._on_disconnected,
            "reconnected_cb": self._on_reconnected,
        }
        if w.event_plane_creds:
            kw["user_credentials"] = w.event_plane_creds
        try:
            tls = _tls(w)
        except (OSError, ssl.SSLError) as exc:
            log.error("dynamo plane %s: TLS files: %s", w.id, exc)
            self._state.count("tls")
            return
        if tls is not None:
            kw["tls"] = tls
        # with max_reconnect_attempts -1, nats-py retries the first connection too (each failure
        # reaches _on_error and is counted), so this returns once the server answers
        self.nc = await nats.connect(**kw)
        for subject in self.plan.subjects:
            # generous client-side buffers: a slow consumer drops messages (counted), never blocks
            await self.nc.subscribe(
                subject, cb=self._on_msg, pending_msgs_limit=1 << 20, pending_bytes_limit=1 << 30
            )
        await self.nc.flush()
        self._state.connected.add(self.plan.shown)
        log.info(
            "dynamo plane %s: subscribed to %s on %s", w.id, self.plan.subjects, self.plan.shown
        )

    async def _on_msg(self, msg: Msg) -> None:
        self.table.on_nats(self.index, msg.subject, msg.data)

    async def _on_error(self, exc: Exception) -> None:
        from nats.errors import SlowConsumerError

        name = "slow_consumer" if isinstance(exc, SlowConsumerError) else "connection"
        if not self._state.errors.get(name):
            log.warning("dynamo plane %s: %s: %s", self.plan.worker.id, self.plan.shown, exc)
        self._state.count(name)

    async def _on_disconnected(self) -> None:
        self._state.connected.discard(self.plan.shown)

    async def _on_reconnected(self) -> None:
        self._state.connected.add(self.plan.shown)

    async def close(self) -> None:
        """Drop the connection (no drain: buffered messages are not needed any more)."""
        nc, self.nc = self.nc, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await nc.close()


class _ZmqPlane:
    """ZMQ direct: one SUB per advertised endpoint, every topic (the frames say which)."""

    def __init__(self, index: int, plan: DynamoPlan, table: DynamoTable) -> None:
        self.index, self.plan, self.table = index, plan, table
        self.ctx = zmq.asyncio.Context()
        self._socks: list[zmq.asyncio.Socket] = []
        self._state = table.planes[index]

    async def run(self) -> None:
        """Connect every endpoint and receive until cancelled."""
        tasks = []
        for ep in self.plan.endpoints:
            sock = self.ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 100_000)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5_000)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            mon = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            try:
                sock.connect(ep)
            except zmq.ZMQError as exc:
                self._state.count("connect")
                log.warning("dynamo plane %s: cannot connect %s: %s", self.plan.worker.id, ep, exc)
                continue
            self._socks += [sock, mon]
            tasks += [self._recv(sock, ep), self._monitor(mon, ep)]
        await asyncio.gather(*tasks)

    async def _recv(self, sock: zmq.asyncio.Socket, ep: str) -> None:
        on_zmq, index = self.table.on_zmq, self.index
        n = 0
        while True:
            try:
                frames = await sock.recv_multipart()
            except zmq.ZMQError:
                return  # closed under us
            on_zmq(index, ep, frames)
            n += 1
            if n % _YIELD_EVERY == 0:
                # a recv that finds a message waiting completes without yielding: under a
                # backlog this loop would hold the thread's event loop, and stats() (the
                # collector's snapshot) would wait until the socket ran dry
                await asyncio.sleep(0)

    async def _monitor(self, mon: zmq.asyncio.Socket, ep: str) -> None:
        while True:
            try:
                event = parse_monitor_message(await mon.recv_multipart())
            except zmq.ZMQError:
                return
            if event["event"] == zmq.EVENT_CONNECTED:
                self._state.connected.add(ep)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._state.connected.discard(ep)

    async def close(self) -> None:
        """Close every socket and the context (linger 0)."""
        for s in self._socks:
            s.close(linger=0)
        self.ctx.destroy(linger=0)


class DynamoIngest:
    """The Dynamo planes of one collector, in their own thread and event loop."""

    def __init__(
        self,
        plans: Sequence[DynamoPlan],
        options: DynamoOptions | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.plans = list(plans)
        self.table = DynamoTable(plans, options, clock=clock, wall=wall)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvobserve-dynamo", daemon=True)

    def start(self) -> None:
        """Start the thread; returns once its loop runs (connections go on in the background)."""
        self._thread.start()
        self._ready.wait(5.0)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception:  # the thread must not die silently
            log.exception("dynamo ingest failed")

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        planes: list[_NatsPlane | _ZmqPlane] = [
            (_NatsPlane if p.event_plane == "nats" else _ZmqPlane)(i, p, self.table)
            for i, p in enumerate(self.plans)
        ]
        tasks = [asyncio.create_task(p.run(), name=f"dynamo-{p.plan.worker.id}") for p in planes]
        self._ready.set()
        try:
            while not self._stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), _EXPIRE_EVERY_S)
                self.table.expire()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for p in planes:
                await p.close()

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` in the ingest loop; the Future gets its result or exception."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        loop = self._loop
        if loop is None or loop.is_closed() or not self._thread.is_alive():
            fut.set_exception(RuntimeError("dynamo ingest is not running"))
            return fut

        def run() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except Exception as exc:
                    fut.set_exception(exc)

        try:
            loop.call_soon_threadsafe(run)
        except RuntimeError as exc:  # the loop closed meanwhile
            fut.set_exception(exc)
        return fut

    def overlap(
        self, hashes: list[BlockHash], workers: frozenset[str] | None = None
    ) -> concurrent.futures.Future[list[RankOverlap]]:
        """The leading blocks of `hashes` each stream holds (DynamoTable.overlap), in the loop."""
        return self.call(lambda: self.table.overlap(hashes, workers))

    def stats(self) -> concurrent.futures.Future[DynamoStats]:
        """A consistent picture of every Dynamo stream, built in the ingest thread."""
        return self.call(self.table.stats)

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the loop, close every connection; idempotent."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        if self._thread.is_alive():
            self._thread.join(timeout)
