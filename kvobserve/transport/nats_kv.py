"""The optional JetStream KV bucket that keeps each collector's last snapshot (warm restarts).

Collectors put every snapshot part they publish (key `<bucket>.<collector id>`, history 1, TTL);
a restarted aggregator reads the keys of its buckets once and is warm at once. A slow bucket never holds up publishing:
only the newest unsent snapshot per collector is kept, and failures are counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js.kv import KeyValue

from kvobserve.aio import cancel_and_wait
from kvobserve.transport import TransportCounters
from kvobserve.transport.subjects import kv_bucket

log = logging.getLogger(__name__)


class SnapshotBucket:
    """One cluster's snapshot bucket; `put` is non-blocking, one writer task owns the writes."""

    def __init__(
        self,
        kv: KeyValue,
        name: str,
        counters: TransportCounters,
        connected: Callable[[], bool],
        warn_once: Callable[[str, str], None],
        read_timeout_s: float,
    ) -> None:
        self.kv, self.name = kv, name
        self._counters, self._connected, self._warn_once = counters, connected, warn_once
        self._read_timeout_s = read_timeout_s
        self._pending: dict[str, bytes] = {}  # key -> newest snapshot not yet put
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @staticmethod
    async def open_kv(nc: Client, cluster: str, ttl_s: float, timeout_s: float) -> KeyValue:
        """The cluster's bucket, created when absent; TimeoutError or nats.errors.Error."""
        bucket = kv_bucket(cluster)
        js = nc.jetstream(timeout=timeout_s)
        async with asyncio.timeout(timeout_s * 2):
            try:
                return await js.key_value(bucket)
            except nats.js.errors.BucketNotFoundError:
                return await js.create_key_value(bucket=bucket, history=1, ttl=ttl_s)

    def put(self, key: str, data: bytes) -> None:
        """Queue `data` for `key`; an older unsent value of the key is replaced."""
        self._pending[key] = data
        self._wakeup.set()
        if self._task is None:
            self._task = asyncio.create_task(self._writer(), name="kvobserve-kv-writer")

    async def _writer(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._pending:
                key, data = self._pending.popitem()
                if not self._connected():
                    self._counters.drop("kv_disconnected")
                    continue
                try:
                    async with asyncio.timeout(2.0):
                        await self.kv.put(key, data)
                except (TimeoutError, nats.errors.Error) as exc:
                    self._warn_once("kv_error", f"nats: KV put of {key!r} failed: {exc!r}")

    async def read_all(self, filters: list[str]) -> list[tuple[bytes, float]]:
        """(snapshot bytes, wall-clock time it was stored) per key matching one of `filters`;
        what it could read."""
        out: list[tuple[bytes, float]] = []
        for keys in filters:
            if not await self._read(keys, out):
                break
        return out

    async def _read(self, keys: str, out: list[tuple[bytes, float]]) -> bool:
        """Append the values of the keys matching `keys`; False when the bucket failed."""
        try:
            watcher = await self.kv.watch(keys, ignore_deletes=True)
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("nats: cannot read KV bucket %s, starting cold: %r", self.name, exc)
            return False
        try:
            async with asyncio.timeout(self._read_timeout_s):
                async for entry in watcher:
                    if entry is None:  # nats-py's marker: the initial values are all delivered
                        break
                    if entry.value:
                        created = entry.created.timestamp() if entry.created else time.time()
                        out.append((entry.value, created))
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning(
                "nats: reading KV bucket %s failed after %d entries: %r", self.name, len(out), exc
            )
            return False
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()
        return True

    async def close(self) -> None:
        """Stop the writer task; safe to call twice."""
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
