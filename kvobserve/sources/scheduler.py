"""Scheduler metrics per DP rank: engine /metrics scrape, SGLang load PUB, KvMetrics PULL, FPM SUB.

Each source keeps the latest normalized values per dp_rank; `SchedulerSources` merges the sources
of one worker field by field, the freshest value winning. Bad input is counted by reason; each
source's `health` says why it does (not) deliver, logged once per change.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields, replace

import aiohttp
import zmq
import zmq.asyncio
from prometheus_client.metrics_core import Metric

from kvobserve.aio import cancel_and_wait
from kvobserve.sources.health import Health
from kvobserve.sources.passthrough import parse_engine_metrics
from kvobserve.sources.periodic import PeriodicPoll, http_failure_reason, http_status_reason
from kvobserve.sources.plan import SchedulerSpec
from kvobserve.wire.errors import WireError
from kvobserve.wire.scheduler import (
    decode_forward_pass_message,
    decode_kv_metrics,
    decode_load_message,
)

Clock = Callable[[], float]
# A side channel silent for this many snapshot intervals (at least MIN_SILENT_S) is down: the
# load and FPM publishers send at least once a second while their engine runs, idle or not, so
# ten missed in a row is no jitter (a long prefill delays a heartbeat by a second or two) and a
# dead engine still shows within 10 s by default. (The scrape needs none: each poll says.)
SILENT_INTERVALS = 10
MIN_SILENT_S = 3.0  # short intervals (tests) must not call a 1 s heartbeat silent


@dataclass(slots=True)
class SchedulerValues:
    """Normalized scheduler state of one DP rank; None where no source said."""

    running_requests: float | None = None
    queued_requests: float | None = None
    token_usage_ratio: float | None = None
    cache_hit_ratio: float | None = None
    max_total_tokens: float | None = None
    source: str = ""  # the sources that reported this rank, `+`-joined
    updated_at: float = 0.0  # wall-clock time of that update


VALUE_FIELDS = tuple(f.name for f in fields(SchedulerValues))[:5]
WORKER = -1  # the "rank" of a worker-wide prefix counter (MetricsScrape.prefix)


class _Source:
    """Latest values per dp_rank plus counters; subclasses feed `_set`."""

    name = ""
    # What silence means (check_silence): "down" for a source that heartbeats, "idle" for one
    # that sends only when its engine works, "" for the scrape (each poll says how it went).
    silence = ""

    def __init__(self, clock: Clock = time.time) -> None:
        self._clock = clock
        self._values: dict[int, SchedulerValues] = {}
        self.endpoints: list[str] = []  # what this source connects to, binds or scrapes
        self.messages_total = 0
        self.errors: Counter[str] = Counter()  # by reason
        self.created = clock()
        self.last_message = 0.0  # wall-clock time of the last message; 0 = none yet
        self.health = Health("", "waiting", "no message yet", clock())  # named by SchedulerSources

    def check_silence(self, after_s: float) -> None:
        """Down (or idle) after `after_s` without a message; a message makes it up again."""
        now = self._clock()
        if not self.silence or now - (self.last_message or self.created) < after_s:
            return
        if self.silence == "down" and self.health.state != "down":
            what = "no message" if self.last_message else "nothing received"
            self.health.set(
                "down",
                f"{what} for {after_s:g} s (it sends every second while its engine runs)",
                now,
            )
        elif self.silence == "idle" and self.health.state == "up":
            self.health.set(
                "idle", f"no message for {after_s:g} s (none is sent while the engine idles)", now
            )

    def _set(self, rank: int, now: float, **vals: float | None) -> None:
        v = self._values.get(rank)
        if v is None:
            v = self._values[rank] = SchedulerValues(source=self.name)
        for k, x in vals.items():
            setattr(v, k, x)
        v.updated_at = now

    def values(self) -> dict[int, SchedulerValues]:
        """dp_rank -> a copy of the latest values."""
        return {r: replace(v) for r, v in self._values.items()}

    async def start(self) -> None:
        """Begin receiving."""

    async def close(self) -> None:
        """Stop; safe to call twice."""


class MetricsScrape(_Source):
    """Scrapes an engine's Prometheus /metrics and maps known names per DP rank."""

    name = "metrics"

    def __init__(
        self,
        url: str,
        engine: str,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        clock: Clock = time.time,
    ) -> None:
        super().__init__(clock)
        self.url, self.engine, self.interval_s, self.timeout_s = url, engine, interval_s, timeout_s
        self.endpoints = [url]
        self.up = False
        self.families: list[Metric] = []  # the last scrape, kept for passthrough
        self._counters: dict[int, tuple[float, float]] = {}  # vLLM prefix (hits, queries)
        # the engine's prefix-cache counters as last scraped, (hit tokens, query tokens) per
        # rank, WORKER for the whole worker's (SGLang's tokenizer): the miss split's hits
        self.prefix: dict[int, tuple[float, float]] = {}
        self._poll = PeriodicPoll(f"scrape {url}", interval_s, self.scrape_once)

    def ingest(self, text: str, now: float | None = None) -> None:
        """Parse one /metrics body and update the values; a malformed body counts as `parse`."""
        now = self._clock() if now is None else now
        try:
            scrape = parse_engine_metrics(text, self.engine)
        except ValueError:
            self.errors["parse"] += 1
            self.up = False
            self.health.set("down", "the answer is not Prometheus text", now)
            return
        self.families, self.messages_total, self.up = scrape.families, self.messages_total + 1, True
        self.health.set("up", "scraping", now)
        if scrape.bad_rank_labels:
            self.errors["rank_label"] += scrape.bad_rank_labels
        found: dict[int, dict[str, float | None]] = {r: dict(v) for r, v in scrape.values.items()}
        self.prefix = dict(scrape.prefix)
        if scrape.worker_prefix is not None:
            self.prefix[WORKER] = scrape.worker_prefix
        for rank, (hits, queries) in scrape.prefix.items():
            prev = self._counters.get(rank)
            self._counters[rank] = (hits, queries)
            if prev is not None and queries > prev[1] and hits >= prev[0]:  # else a reset
                ratio = (hits - prev[0]) / (queries - prev[1])
                found.setdefault(rank, {})["cache_hit_ratio"] = ratio
        for rank, got in found.items():
            self._set(rank, now, **got)

    async def scrape_once(self) -> None:
        """One GET + ingest; failures count by reason and mark the source down."""
        try:
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            async with self._poll.session().get(self.url, timeout=timeout) as resp:
                if resp.status != 200:
                    self.errors["status"] += 1
                    self.up = False
                    self.health.set(
                        "down", http_status_reason(resp.status, resp.reason), self._clock()
                    )
                    return
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError, OSError, UnicodeDecodeError) as exc:
            self.errors["connection"] += 1
            self.up = False
            self.health.set("down", http_failure_reason(exc, self.timeout_s), self._clock())
            return
        self.ingest(text)

    async def start(self) -> None:
        """Scrape every `interval_s` in the background."""
        await self._poll.start()

    async def close(self) -> None:
        """Stop scraping and close the HTTP session; safe to call twice."""
        await self._poll.close()


# --- ZMQ side channels ----------------------------------------------------------------------


class _ZmqSource(_Source):
    """Sockets with one receive task each; frames go to `_handle(frames, rank, now)`."""

    def __init__(self, ctx: zmq.asyncio.Context | None, clock: Clock) -> None:
        super().__init__(clock)
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._socks: list[tuple[zmq.asyncio.Socket, int]] = []
        self._tasks: list[asyncio.Task[None]] = []

    def _open(self) -> None:
        raise NotImplementedError

    def _handle(self, frames: Sequence[bytes], rank: int, now: float) -> None:
        raise NotImplementedError

    async def _recv(self, sock: zmq.asyncio.Socket, rank: int) -> None:
        while True:
            try:
                frames = await sock.recv_multipart()
            except zmq.ZMQError:
                return  # socket closed under us
            self.messages_total += 1
            now = self.last_message = self._clock()
            try:
                self._handle(frames, rank, now)
            except WireError as exc:
                self.errors[exc.reason] += 1
                self.health.set("undecodable", f"messages do not decode ({exc.reason})", now)
            except (ValueError, TypeError, ArithmeticError):  # decodable but nonsensical values
                self.errors["schema"] += 1
                self.health.set("undecodable", "messages do not decode (schema)", now)
            else:
                self.health.set("up", "receiving", now)

    async def start(self) -> None:
        """Open the sockets and start receiving."""
        if self._tasks:
            return
        try:
            self._open()
        except zmq.ZMQError:
            await self.close()
            raise
        self._tasks = [asyncio.create_task(self._recv(s, r)) for s, r in self._socks]

    async def close(self) -> None:
        """Cancel the receive tasks and close sockets with linger 0; safe to call twice."""
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(*tasks)
        socks, self._socks = self._socks, []
        for s, _ in socks:
            s.close(linger=0)


class _SubPerRank(_ZmqSource):
    """One SUB per rank: `endpoints[i]` carries rank `ranks[i]`."""

    topic = b""

    def __init__(
        self,
        endpoints: Sequence[str],
        ranks: Sequence[int],
        *,
        ctx: zmq.asyncio.Context | None = None,
        clock: Clock = time.time,
    ) -> None:
        super().__init__(ctx, clock)
        self._ranks = list(ranks)
        self.endpoints = list(endpoints)

    def _open(self) -> None:
        for r, ep in zip(self._ranks, self.endpoints, strict=True):
            s = self._ctx.socket(zmq.SUB)
            self._socks.append((s, r))
            s.setsockopt(zmq.SUBSCRIBE, self.topic)
            s.connect(ep)


class LoadSubscriber(_SubPerRank):
    """SGLang load PUB per rank (`base + r`), topic `load`: LoadStat (1 s heartbeat)."""

    name, topic, silence = "load", b"load", "down"

    def _handle(self, frames: Sequence[bytes], rank: int, now: float) -> None:
        _, st = decode_load_message(frames)
        cap = st.max_total_num_tokens  # 0 means unknown
        self._set(
            rank,
            now,
            running_requests=st.num_running_reqs,
            queued_requests=st.num_waiting_reqs,
            token_usage_ratio=st.num_tokens / cap if cap > 0 else None,
            max_total_tokens=cap if cap > 0 else None,
        )


class KvMetricsPull(_ZmqSource):
    """SGLang KvMetrics: we BIND a PULL the schedulers PUSH to; rank from the message."""

    name, silence = "kv_metrics", "idle"  # pushed at the scheduler's refresh points only

    def __init__(
        self,
        endpoint: str,
        *,
        allow_pickle: bool = False,
        ctx: zmq.asyncio.Context | None = None,
        clock: Clock = time.time,
    ) -> None:
        super().__init__(ctx, clock)
        self.endpoints, self.allow_pickle = [endpoint], allow_pickle

    def _open(self) -> None:
        s = self._ctx.socket(zmq.PULL)
        self._socks.append((s, -1))
        s.bind(self.endpoints[0])

    def _handle(self, frames: Sequence[bytes], rank: int, now: float) -> None:
        if len(frames) != 1:
            raise WireError("frame_count", f"KvMetrics: {len(frames)} frames, expected 1")
        m = decode_kv_metrics(frames[0], allow_pickle=self.allow_pickle)
        self._set(
            m.data_parallel_rank or 0,
            now,
            running_requests=m.request_active_slots,
            queued_requests=m.num_requests_waiting,
            token_usage_ratio=m.gpu_cache_usage_perc,
            cache_hit_ratio=m.gpu_prefix_cache_hit_rate,
            max_total_tokens=m.kv_total_blocks if m.kv_total_blocks > 0 else None,  # tokens
        )


class FpmSubscriber(_SubPerRank):
    """SGLang forward-pass metrics PUB per rank (`{base}.{r}` ipc, port + r tcp); an idle
    scheduler sends a heartbeat every second."""

    name, silence = "fpm", "down"

    def _handle(self, frames: Sequence[bytes], rank: int, now: float) -> None:
        _, m = decode_forward_pass_message(frames)
        sch, q = m.scheduled_requests, m.queued_requests
        self._set(
            rank,
            now,
            running_requests=sch.num_prefill_requests + sch.num_decode_requests,
            queued_requests=q.num_prefill_requests + q.num_decode_requests,
        )


def merge_values(per_source: Iterable[dict[int, SchedulerValues]]) -> dict[int, SchedulerValues]:
    """Per rank and field, the value of the most recently updated source that has one.

    `source` names every source that reported the rank (`load+metrics`), so it does not flip
    with whichever was freshest; `updated_at` is the freshest update.
    """
    out: dict[int, SchedulerValues] = {}
    stamps: dict[tuple[int, str], float] = {}
    names: dict[int, set[str]] = {}
    for vals in per_source:
        for rank, v in vals.items():
            m = out.setdefault(rank, SchedulerValues())
            for f in VALUE_FIELDS:
                x = getattr(v, f)
                if x is not None and v.updated_at >= stamps.get((rank, f), -1.0):
                    setattr(m, f, x)
                    stamps[(rank, f)] = v.updated_at
            m.updated_at = max(m.updated_at, v.updated_at)
            names.setdefault(rank, set()).add(v.source)
    for rank, m in out.items():
        m.source = "+".join(sorted(n for n in names[rank] if n))
    return out


class SchedulerSources:
    """The scheduler sources of one worker's plan, merged per dp_rank."""

    def __init__(
        self,
        specs: Sequence[SchedulerSpec],
        engine: str,
        *,
        allow_pickle: bool = False,
        interval_s: float = 1.0,
        ctx: zmq.asyncio.Context | None = None,
        clock: Clock = time.time,
        worker_id: str = "",
    ) -> None:
        self.sources: list[_Source] = []
        self.scrape: MetricsScrape | None = None
        self.silent_after_s = max(SILENT_INTERVALS * interval_s, MIN_SILENT_S)
        # A context of our own (not the process-wide instance), so close() ends its I/O threads.
        self._own_ctx = None
        if ctx is None and any(s.source != "metrics" for s in specs):
            ctx = self._own_ctx = zmq.asyncio.Context()
        for spec in specs:
            if spec.source == "metrics":
                self.scrape = MetricsScrape(
                    spec.endpoints[0], engine, interval_s=interval_s, clock=clock
                )
                self.sources.append(self.scrape)
            elif spec.source == "load":
                self.sources.append(
                    LoadSubscriber(spec.endpoints, spec.ranks, ctx=ctx, clock=clock)
                )
            elif spec.source == "kv_metrics":
                pull = KvMetricsPull(
                    spec.endpoints[0], allow_pickle=allow_pickle, ctx=ctx, clock=clock
                )
                self.sources.append(pull)
            elif spec.source == "fpm":
                self.sources.append(FpmSubscriber(spec.endpoints, spec.ranks, ctx=ctx, clock=clock))
        for src in self.sources:  # named: their changes are logged
            where = ", ".join(src.endpoints[:2]) + (", ..." if len(src.endpoints) > 2 else "")
            src.health.name = f"worker {worker_id} scheduler source {src.name} ({where})"

    def check_silence(self) -> None:
        """Mark the sources that stopped sending (call every interval)."""
        for s in self.sources:
            s.check_silence(self.silent_after_s)

    def errors(self) -> dict[tuple[str, str], int]:
        """(source, reason) -> count."""
        return {(s.name, r): n for s in self.sources for r, n in s.errors.items()}

    def values(self) -> dict[int, SchedulerValues]:
        """dp_rank -> merged values (freshest source per field)."""
        return merge_values(s.values() for s in self.sources)

    def prefix(self) -> dict[int, tuple[float, float]]:
        """The engine's prefix-cache counters as last scraped: dp_rank (WORKER: the whole
        worker) -> (hit tokens, query tokens); empty while the scrape is down or has none."""
        s = self.scrape
        return dict(s.prefix) if s is not None and s.up else {}

    async def start(self) -> None:
        """Start every source; a ZMQError (e.g. the PULL address in use) propagates: close()."""
        for s in self.sources:
            await s.start()

    async def close(self) -> None:
        """Close every source (and our ZMQ context: no I/O thread stays); safe to call twice."""
        for s in self.sources:
            await s.close()
        ctx, self._own_ctx = self._own_ctx, None
        if ctx is not None:
            ctx.destroy(linger=0)
