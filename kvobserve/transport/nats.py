"""Snapshots and condition events over NATS (nats-py), with an optional JetStream KV bucket.

Subjects: `kvobserve.v1.<cluster>.snapshot.<bucket>.<collector_id>` (msgpack of one snapshot
part, transport/subjects.py), `kvobserve.v1.<cluster>.event.<kind>` (JSON transitions),
`kvobserve.v1.<cluster>.misses` (the aggregator's miss-split feedback to the collectors) and
`kvobserve.v1.<cluster>.overlap` (the aggregator's question, every collector answers). With
`jetstream_kv`, collectors also put each part into `kvobserve_snapshots_<cluster>` (key
`<bucket>.<collector_id>`, history 1, TTL `kv_ttl_s`) so a restarted aggregator (or shard) reads
the last part of each of its collectors at once. See docs/nats.md and docs/scale.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import logging
import os
import random
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client, Server
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from kvobserve.aio import cancel_and_wait
from kvobserve.config import NatsConfig
from kvobserve.transport import (
    Answer,
    Coalescer,
    Handler,
    Take,
    TransportCounters,
    TransportStatus,
)
from kvobserve.transport.nats_kv import SnapshotBucket
from kvobserve.transport.subjects import (
    event_subject,
    event_wildcard,
    kv_bucket,
    kv_filters,
    kv_key,
    misses_subject,
    overlap_subject,
    snapshot_subject,
    snapshot_wildcards,
)
from kvobserve.wire.snapshot import WHOLE

log = logging.getLogger(__name__)
OVERLAP_PENDING = 64  # questions queued at a collector; more are dropped by nats-py (counted)


class NatsConnectError(Exception):
    """The first connection (or the KV bucket) could not be set up; the message says why."""


class NatsTransport:
    """A Transport over one NATS connection; call `connect()` first."""

    @classmethod
    def from_config(
        cls, cfg: NatsConfig, cluster: str, name: str, shard: int = 0, shards: int = 1
    ) -> NatsTransport:
        """The transport a command's validated NATS settings describe."""
        return cls(
            cfg.url,
            cluster,
            user=cfg.user,
            password=cfg.password,
            token=cfg.token,
            creds=cfg.creds,
            tls_ca=cfg.tls_ca,
            tls_cert=cfg.tls_cert,
            tls_key=cfg.tls_key,
            jetstream_kv=cfg.jetstream_kv,
            name=name,
            connect_timeout_s=cfg.connect_timeout_s,
            close_timeout_s=1.0,  # commands must stop within 2 s of SIGTERM
            shard=shard,
            shards=shards,
        )

    def __init__(
        self,
        url: str,
        cluster: str = "default",
        *,
        user: str | None = None,
        password: str | None = None,
        token: str | None = None,
        creds: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        jetstream_kv: bool = False,
        kv_ttl_s: float = 300.0,
        name: str = "kvobserve",
        connect_timeout_s: float = 5.0,
        reconnect_wait_s: float = 0.5,
        reconnect_max_wait_s: float = 5.0,
        pending_bytes: int = 2 * 1024 * 1024,
        close_timeout_s: float = 1.5,
        shard: int = 0,
        shards: int = 1,
    ) -> None:
        self.servers = [u.strip() for u in url.split(",") if u.strip()]
        self.cluster = cluster
        self.status = TransportStatus.CONNECTING
        self.counters = TransportCounters()
        self._auth: dict[str, Any] = {"user": user, "password": password, "token": token}
        self._creds, self._jetstream_kv, self._kv_ttl_s = creds, jetstream_kv, kv_ttl_s
        self._tls = (tls_ca, tls_cert, tls_key)
        self._name, self._pending_bytes = name, pending_bytes
        self._connect_timeout_s, self._close_timeout_s = connect_timeout_s, close_timeout_s
        self._reconnect_wait_s, self._reconnect_max_wait_s = reconnect_wait_s, reconnect_max_wait_s
        self._nc: Client | None = None
        self._kv: SnapshotBucket | None = None
        self._subjects: dict[tuple[str, int], str] = {}  # (collector id, bucket) -> subject
        self.shard, self.shards = shard, shards  # which buckets this aggregator subscribes to
        self._last_error: Exception | None = None
        self._auth_failed = asyncio.Event()
        self._closing = False
        self._warned: set[str] = set()
        self._deliveries: list[asyncio.Task[None]] = []  # one per coalescing subscription

    @property
    def client(self) -> Client | None:
        """The nats-py client (for tests and diagnostics)."""
        return self._nc

    async def connect(self) -> None:
        """Connect within `connect_timeout_s` (or fail with NatsConnectError), then keep reconnecting."""
        if self._creds is not None:
            if not os.path.isfile(self._creds):
                raise NatsConnectError(f"nats creds {self._creds!r}: no such file")
            if importlib.util.find_spec("nkeys") is None:
                raise NatsConnectError(
                    "nats creds: needs the nkeys package (pip install 'nats-py[nkeys]')"
                )
        force_tls = any(u.startswith("tls://") for u in self.servers)
        tls = build_ssl_context(*self._tls, force=force_tls)
        nc = Client()
        self._nc = nc
        opts: dict[str, Any] = {k: v for k, v in self._auth.items() if v is not None}
        if self._creds is not None:
            opts["user_credentials"] = self._creds
        if tls is not None:
            opts["tls"] = tls
        task = asyncio.ensure_future(
            nc.connect(
                self.servers,
                name=self._name,
                error_cb=self._on_error,
                disconnected_cb=self._on_disconnected,
                reconnected_cb=self._on_reconnected,
                closed_cb=self._on_closed,
                allow_reconnect=True,
                max_reconnect_attempts=-1,  # a daemon never gives up on its bus
                connect_timeout=max(1, int(self._connect_timeout_s)),
                reconnect_time_wait=1,  # only used between first-connect attempts
                reconnect_to_server_handler=self._pick_server,
                pending_size=self._pending_bytes,
                drain_timeout=1,
                **opts,
            )
        )
        auth = asyncio.ensure_future(self._auth_failed.wait())
        try:
            done, _ = await asyncio.wait(
                {task, auth}, timeout=self._connect_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        except asyncio.CancelledError:
            await self._abandon(task, nc)
            raise
        finally:
            auth.cancel()
        if task not in done or task.exception() is not None:
            await self._abandon(task, nc)
            why = "authorization failed (check user/password, token or creds)"
            if not self._auth_failed.is_set():
                err = (
                    task.exception() if task.done() and not task.cancelled() else None
                ) or self._last_error
                why = f"{err}" if err else f"no answer within {self._connect_timeout_s:g} s"
            raise NatsConnectError(f"nats {','.join(self.servers)}: {why}")
        self.status = TransportStatus.CONNECTED
        if self._jetstream_kv:
            await self._setup_kv(nc)

    async def _abandon(self, task: asyncio.Future[None], nc: Client) -> None:
        """Stop a first connect that will not be used."""
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        with contextlib.suppress(Exception):
            await nc.close()
        self.status = TransportStatus.CLOSED

    async def _setup_kv(self, nc: Client) -> None:
        """Open the snapshot bucket, creating it when absent."""
        try:
            kv = await SnapshotBucket.open_kv(
                nc, self.cluster, self._kv_ttl_s, self._connect_timeout_s
            )
        except (TimeoutError, nats.errors.Error) as exc:
            await self.close()
            raise NatsConnectError(
                f"nats JetStream KV bucket {kv_bucket(self.cluster)!r}: "
                f"{exc or type(exc).__name__} (is the server started with JetStream, -js?)"
            ) from None
        self._kv = SnapshotBucket(
            kv, kv_bucket(self.cluster), self.counters, self._connected, self._drop_once,
            self._connect_timeout_s,
        )  # fmt: skip

    def _connected(self) -> bool:
        return self.status is TransportStatus.CONNECTED

    def _pick_server(
        self, servers: list[Server], info: dict[str, Any]
    ) -> tuple[Server | None, float]:
        """Exponential backoff with jitter, so a fleet of collectors does not reconnect in lockstep."""
        s = min(servers, key=lambda srv: srv.reconnects)
        delay = min(self._reconnect_max_wait_s, self._reconnect_wait_s * 2 ** min(s.reconnects, 16))
        return s, delay * random.uniform(0.5, 1.0)

    async def publish_snapshot(self, collector_id: str, data: bytes, bucket: int = WHOLE) -> None:
        """Publish one snapshot part (and queue it for the KV bucket); failures are counted."""
        key = (collector_id, bucket)
        subject = self._subjects.get(key)
        if subject is None:
            subject = self._subjects[key] = snapshot_subject(self.cluster, collector_id, bucket)
        if await self._publish(subject, data) and self._kv is not None:
            self._kv.put(kv_key(collector_id, bucket), data)

    async def publish_event(self, kind: str, data: bytes) -> None:
        """Publish one condition transition (JSON bytes)."""
        await self._publish(event_subject(self.cluster, kind), data)  # rare: no subject cache

    async def _publish(self, subject: str, data: bytes) -> bool:
        """Hand one message to nats-py; while disconnected it buffers up to `pending_bytes`."""
        nc = self._nc
        if nc is None or self._closing:
            self.counters.drop("closed")
            return False
        try:
            await nc.publish(subject, data)
        except nats.errors.OutboundBufferLimitError:
            self._drop_once("buffer_full", "nats: disconnected and the outbound buffer is full")
            return False
        except nats.errors.MaxPayloadError:
            self._drop_once("too_large", f"nats: {len(data)} bytes exceed the server's max_payload")
            return False
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError):
            self.counters.drop("closed")
            return False
        except nats.errors.Error as exc:
            self._drop_once("error", f"nats: publish failed: {exc}")
            return False
        self.counters.published += 1
        return True

    def _drop_once(self, reason: str, message: str) -> None:
        """Count a dropped message; warn the first time per reason only."""
        self.counters.drop(reason)
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning("%s (counted as dropped, reason=%s; warned once)", message, reason)

    async def subscribe_snapshots(self, handler: Handler) -> None:
        """Deliver this shard's snapshot parts to `handler` (while it is busy: the newest per
        subject, i.e. per collector and bucket)."""
        # Snapshots are cumulative, so a replaced one loses nothing; it is counted as `coalesced`.
        subjects = snapshot_wildcards(self.cluster, self.shard, self.shards)
        await self._subscribe(subjects, handler, True, True)

    async def publish_feedback(self, data: bytes) -> None:
        """The aggregator's miss-split feedback to every collector (small, every interval)."""
        await self._publish(misses_subject(self.cluster), data)

    async def subscribe_feedback(self, handler: Handler) -> None:
        """Deliver the aggregators' miss-split feedback to `handler` (a collector's)."""
        await self._subscribe([misses_subject(self.cluster)], handler, False)

    async def subscribe_events(self, handler: Handler) -> None:
        """Deliver every condition event of this cluster to `handler`."""
        await self._subscribe([event_wildcard(self.cluster)], handler, False)

    async def _subscribe(
        self, subjects: list[str], handler: Handler, count: bool, coalesce: bool = False
    ) -> None:
        nc = self._nc
        if nc is None:
            raise RuntimeError("NatsTransport.connect() was not called")
        subject = subjects[0]
        box = None
        if coalesce:  # nats-py would queue 512k messages behind a slow handler before dropping
            box = Coalescer(lambda data: self._handle(handler, data, subject, count), self.counters)
            self._deliveries.append(box.task)

        for one in subjects:
            subs: list[Subscription] = []  # the subscription, once made: its backlog
            subs.append(
                await nc.subscribe(one, cb=self._on_msg(handler, subject, count, box, subs))
            )
        await self._registered(nc)  # before callers rely on the interest

    def _on_msg(
        self,
        handler: Handler,
        subject: str,
        count: bool,
        box: Coalescer | None,
        subs: list[Subscription],
    ) -> Callable[[Msg], Awaitable[None]]:
        """A subscription's callback: with no backlog (nothing queued in nats-py or in the
        coalescer) the handler runs at once, a loop turn sooner and cheaper; else the message
        waits in the coalescer, which keeps only the newest per subject."""

        async def on_msg(msg: Msg) -> None:
            if box is None or (box.idle and (not subs or subs[0].pending_msgs == 0)):
                await self._handle(handler, msg.data, subject, count)
            else:
                box.put(msg.subject, msg.data)

        return on_msg

    async def _handle(self, handler: Handler, data: bytes, subject: str, count: bool) -> None:
        """Run the subscriber's handler on one message; it raising is counted, never fatal."""
        try:
            result = handler(data)
            if inspect.isawaitable(result):
                await result
        except Exception:
            self.counters.handler_errors += 1
            if "handler" not in self._warned:
                self._warned.add("handler")
                log.warning("nats: the %s handler raised (warned once)", subject, exc_info=True)
            return
        if count:
            self.counters.received += 1

    async def retained_snapshots(self) -> list[tuple[bytes, float]]:
        """(snapshot bytes, wall-clock time it was stored) per collector in the KV bucket."""
        if self._kv is None:
            return []
        return await self._kv.read_all(kv_filters(self.shard, self.shards))

    async def serve_overlap(self, collector_id: str, answer: Answer) -> None:
        """Answer every overlap question on `kvobserve.v1.<cluster>.overlap` on its reply
        subject, one at a time (each takes microseconds of the ingest thread)."""
        nc = self._nc
        if nc is None:
            raise RuntimeError("NatsTransport.connect() was not called")

        async def on_question(msg: Msg) -> None:
            if not msg.reply:
                return
            try:
                data = await answer(msg.data)
            except Exception:
                self.counters.handler_errors += 1
                if "overlap" not in self._warned:
                    self._warned.add("overlap")
                    log.warning("nats: answering an overlap question failed (warned once)",
                                exc_info=True)  # fmt: skip
                return
            with contextlib.suppress(nats.errors.Error):  # the asker gives up, counts it missing
                await nc.publish(msg.reply, data)

        await nc.subscribe(
            overlap_subject(self.cluster), cb=on_question, pending_msgs_limit=OVERLAP_PENDING
        )
        await self._registered(nc)  # the first question finds it

    async def _registered(self, nc: Client) -> None:
        """Wait until the server has processed what this connection sent so far (its
        subscriptions): a message to ourselves travels behind them. nats-py's flush() would not
        do: it writes its PING ahead of the commands still buffered, so its PONG can come back
        before a subscription sent just before it is registered (seen: a collector missing the
        first question). Gives up silently after the connect timeout."""
        probe = await nc.subscribe(nc.new_inbox(), max_msgs=1)
        try:
            await nc.publish(probe.subject, b"")
            await probe.next_msg(timeout=max(1.0, self._connect_timeout_s))
        except (nats.errors.Error, TimeoutError):
            pass
        finally:
            with contextlib.suppress(nats.errors.Error):
                await probe.unsubscribe()

    async def ask_overlap(self, question: bytes, timeout_s: float, take: Take) -> None:
        """Publish `question` with a reply inbox of its own; hand every answer to `take` until
        it has what it waits for or `timeout_s` passed."""
        nc = self._nc
        if nc is None or self._closing or not nc.is_connected:
            return  # nobody can answer: the asker reports every collector missing
        answers: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_answer(msg: Msg) -> None:
            answers.put_nowait(msg.data)

        sub = await nc.subscribe(nc.new_inbox(), cb=on_answer)
        try:
            await nc.publish(overlap_subject(self.cluster), question, reply=sub.subject)
            async with asyncio.timeout(timeout_s):
                while not take(await answers.get()):
                    pass
        except (TimeoutError, nats.errors.Error):
            pass  # who did not answer in time is the asker's to report
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def close(self) -> None:
        """Stop the KV writer, drain (or close) the connection within `close_timeout_s`."""
        if self._closing:
            return
        self._closing = True
        await cancel_and_wait(*self._deliveries)
        self._deliveries.clear()
        if self._kv is not None:
            await self._kv.close()
        nc = self._nc
        if nc is not None and not nc.is_closed:
            try:
                async with asyncio.timeout(self._close_timeout_s):
                    if nc.is_connected:
                        await nc.drain()
                    else:
                        await nc.close()
            except (TimeoutError, nats.errors.Error):
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(nc.close(), 0.5)
        self.status = TransportStatus.CLOSED

    async def _on_error(self, exc: Exception) -> None:
        self._last_error = exc
        if isinstance(exc, nats.errors.SlowConsumerError):
            self._drop_once("slow_consumer", "nats: slow consumer, messages dropped by the client")
            return
        if "authorization" in str(exc).lower():
            self._auth_failed.set()
        text = str(exc) or type(exc).__name__
        text = text if text.startswith("nats:") else f"nats: {text}"
        if self.status is TransportStatus.CONNECTED:
            log.warning("%s", text)
        else:  # reconnect attempts fail every few seconds; the disconnect itself was logged
            log.debug("%s", text)

    async def _on_disconnected(self) -> None:
        if not self._closing and self.status is TransportStatus.CONNECTED:
            self.status = TransportStatus.RECONNECTING
            log.warning("nats: disconnected from %s; reconnecting", ",".join(self.servers))

    async def _on_reconnected(self) -> None:
        self.status = TransportStatus.CONNECTED
        self.counters.reconnects += 1
        url = getattr(self._nc and self._nc.connected_url, "netloc", "?")
        log.info("nats: reconnected to %s", url)

    async def _on_closed(self) -> None:
        self.status = TransportStatus.CLOSED


def build_ssl_context(
    ca: str | None, cert: str | None, key: str | None, *, force: bool = False
) -> ssl.SSLContext | None:
    """A client TLS context from PEM files; None when no TLS is asked for."""
    if not (ca or cert or key or force):
        return None
    try:
        ctx = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise NatsConnectError(f"nats tls_ca {ca!r}: cannot load: {exc}") from None
    if cert or key:
        if not (cert and key):
            raise NatsConnectError("nats tls_cert/tls_key: set both or neither")
        try:
            ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise NatsConnectError(f"nats tls_cert {cert!r} / tls_key {key!r}: {exc}") from None
    return ctx
