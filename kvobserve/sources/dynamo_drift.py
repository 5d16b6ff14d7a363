"""Router-index drift of one Dynamo plane: poll an indexer, compare with the event-derived index.

Every `drift_interval_s`: open a window in the ingest thread (every block a stream of the plane
stores or removes from now on is noted), wait `drift_lag_s`, ask the indexer (`GET /dump`, or
`POST /query` for tree sizes), wait `drift_lag_s` again, close the window and take each stream's
resident blocks. Blocks noted in the window are in flight (the router may have seen them or not);
the others are compared: phantom (the router holds, the engine evicted), missing (the engine
holds, the router lacks), Jaccard similarity. A stream that was cleared or restarted during the
window keeps its previous result. The comparison runs on the collector's loop, the set arithmetic
in an executor thread; failures are counted by reason, never raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from kvobserve.aio import cancel_and_wait
from kvobserve.analysis.drift import Drift, compare_blocks, compare_sizes
from kvobserve.sources.dynamo_ingest import DynamoIngest
from kvobserve.sources.dynamo_plan import DynamoPlan, redact
from kvobserve.sources.dynamo_state import Key, Touched
from kvobserve.wire.dynamo import medium_of
from kvobserve.wire.dynamo_indexer import IndexerDump, decode_dump, decode_tree_sizes
from kvobserve.wire.errors import WireError
from kvobserve.wire.snapshot import DriftSource, DriftStats

log = logging.getLogger(__name__)
_GPU = medium_of("device")


def indexer_endpoint(url: str, api: str) -> str:
    """`/dump` or `/query` under the configured URL (kept as it is if it already names one)."""
    base = url.rstrip("/")
    return base if base.endswith(("/dump", "/query")) else f"{base}/{api}"


def compare(
    plan: DynamoPlan,
    answer: IndexerDump | dict[tuple[int, int], int],
    ours: dict[Key, Touched],
    at: float,
) -> tuple[dict[tuple[str, int, str], DriftStats], int]:
    """Drift per (worker_id, dp_rank, medium) of every settled stream, and the router's streams
    kvobserve never saw (ranks this collector keeps only)."""
    out: dict[tuple[str, int, str], DriftStats] = {}
    seen: set[tuple[int, int]] = set()
    for (label, rank), t in ours.items():
        seen.add((t.dynamo_worker_id, rank))
        if t.unsettled:
            continue
        if isinstance(answer, IndexerDump):
            media = set(t.resident) | {
                m for (w, r, m) in answer.blocks if (w, r) == (t.dynamo_worker_id, rank)
            }
            for m in sorted(media):
                router = answer.blocks.get((t.dynamo_worker_id, rank, m), set())
                d = compare_blocks(router, t.resident.get(m, set()), t.touched)
                out[(label, rank, m)] = _stats(label, rank, m, "dump", d, t.complete, at)
        else:
            size = answer.get((t.dynamo_worker_id, rank))
            if size is None:
                continue  # not in this answer: unknown, not zero
            engine = len(t.resident.get(_GPU, ()))
            d = compare_sizes(size, engine, len(t.touched))
            out[(label, rank, _GPU)] = _stats(label, rank, _GPU, "size", d, t.complete, at)
    keys = (
        {(w, r) for (w, r, _) in answer.blocks} if isinstance(answer, IndexerDump) else set(answer)
    )
    unseen = sum(1 for (w, r) in keys - seen if plan.keeps(r))
    return out, unseen


def _stats(
    label: str, rank: int, medium: str, method: str, d: Drift, complete: bool, at: float
) -> DriftStats:
    jac = None if d.jaccard is None else round(d.jaccard, 6)
    return DriftStats(
        label, rank, medium, method, d.router_blocks, d.engine_blocks, d.phantom, d.missing,
        d.in_flight, jac, complete, at,
    )  # fmt: skip


class DriftPoller:
    """Periodic drift comparisons of one plane against its `indexer_url`."""

    def __init__(
        self, plan: DynamoPlan, ingest: DynamoIngest, *, wall: Callable[[], float] = time.time
    ) -> None:
        w = plan.worker
        assert w.indexer_url is not None
        self.plan, self.ingest, self._wall = plan, ingest, wall
        self.url = indexer_endpoint(w.indexer_url, w.indexer_api)
        self.results: dict[tuple[str, int, str], DriftStats] = {}
        self.source = DriftSource(
            w.id, redact(self.url), "dump" if w.indexer_api == "dump" else "size"
        )
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Compare every `drift_interval_s` in the background (the first one after one interval)."""
        self._session = aiohttp.ClientSession()
        self._task = asyncio.create_task(self._loop(), name=f"drift-{self.plan.worker.id}")

    async def _loop(self) -> None:
        interval = self.plan.worker.drift_interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                await self.compare_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # one failed comparison must not end the poller
                log.exception("drift comparison of %s failed", self.plan.worker.id)
                self._count("error")

    def _count(self, result: str) -> None:
        c = self.source.comparisons
        c[result] = c.get(result, 0) + 1

    async def compare_once(self) -> str:
        """One comparison; returns its result (ok, or the reason it failed), also counted."""
        w, idx = self.plan.worker, self.plan.index
        table = self.ingest.table
        started = time.monotonic()
        await asyncio.wrap_future(self.ingest.call(lambda: table.start_touch(idx)))
        body: bytes | None = None
        try:
            await asyncio.sleep(w.drift_lag_s)
            result, body = await self._fetch()
            at = self._wall()
            if body is not None:
                await asyncio.sleep(w.drift_lag_s)
        finally:
            ours = await asyncio.wrap_future(self.ingest.call(lambda: table.end_touch(idx)))
        if body is None:
            self._count(result)
            return result
        loop = asyncio.get_running_loop()
        try:
            results, unseen = await loop.run_in_executor(None, self._evaluate, body, ours, at)
        except WireError as exc:
            log.warning("drift %s: %s: %s", w.id, self.source.url, exc)
            self._count("decode")
            return "decode"
        for key in [k for k in self.results if (k[0], k[1]) not in ours]:
            del self.results[key]  # the stream is gone
        stale = {(k[0], k[1]) for k in results}
        for key in [k for k in self.results if (k[0], k[1]) in stale]:
            del self.results[key]  # replaced by this round (a medium may have emptied)
        self.results.update(results)
        self.source.unseen_streams = unseen
        self.source.last_ok = at
        self.source.duration_s = round(time.monotonic() - started, 3)
        self._count("ok")
        return "ok"

    def _evaluate(
        self, body: bytes, ours: dict[Key, Touched], at: float
    ) -> tuple[dict[tuple[str, int, str], DriftStats], int]:
        w = self.plan.worker
        answer: IndexerDump | dict[tuple[int, int], int]
        if w.indexer_api == "dump":
            answer = decode_dump(body, w.indexer_model)
        else:
            answer = decode_tree_sizes(body)
        return compare(self.plan, answer, ours, at)

    async def _fetch(self) -> tuple[str, bytes | None]:
        """(result, body); body None on failure."""
        w = self.plan.worker
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=min(60.0, w.drift_interval_s - 2 * w.drift_lag_s))
        kw: dict[str, Any] = {"timeout": timeout}
        if w.indexer_api == "query":
            kw["json"] = {"token_ids": [], "model_name": w.indexer_model or "default"}
        method = self._session.post if w.indexer_api == "query" else self._session.get
        try:
            async with method(self.url, **kw) as resp:
                if resp.status != 200:
                    return "http", None
                return "ok", await resp.read()
        except TimeoutError:
            return "timeout", None
        except (aiohttp.ClientError, OSError):
            return "connection", None

    def stats(self) -> tuple[list[DriftStats], DriftSource]:
        """The latest results and the source's counters."""
        return [self.results[k] for k in sorted(self.results)], self.source

    async def close(self) -> None:
        """Stop polling; safe to call twice."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        if self._session is not None:
            with contextlib.suppress(Exception):
                await self._session.close()
            self._session = None
