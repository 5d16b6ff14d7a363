"""One process, no NATS: collectors and an aggregator on the in-process bus, plus HTTP (run, demo)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvobserve.aggregator import Aggregator
from kvobserve.analysis.fleet import FleetState
from kvobserve.collector import Collector
from kvobserve.commands.common import Stop, start_http
from kvobserve.config import Config, HttpConfig
from kvobserve.transport.local import LocalBus


@dataclass
class Embedded:
    """Collectors and an aggregator joined by the in-process bus, plus the HTTP server."""

    bus: LocalBus
    aggregator: Aggregator
    collectors: list[Collector]
    stop_http: Stop | None = None

    async def close(self) -> None:
        """Stop HTTP, collectors, the aggregator and the bus; idempotent."""
        if self.stop_http is not None:
            await self.stop_http()
            self.stop_http = None
        await asyncio.gather(*(c.close() for c in self.collectors))
        await self.aggregator.stop()
        await self.bus.close()


async def start_embedded(
    configs: list[Config], http: HttpConfig | None, otlp_endpoint: str | None = None
) -> Embedded:
    """Start one collector per config and the aggregator on one LocalBus; serve `http` if given."""
    bus = LocalBus()
    interval = min((c.collector.interval_s for c in configs), default=1.0)
    # [aggregator] stale_intervals holds here as in `kvobserve aggregate`; the strictest one wins
    stale = min((c.aggregator.stale_intervals for c in configs), default=3.0)
    warn = min((c.aggregator.unvouched_warn_s for c in configs), default=600.0)
    agg = Aggregator(FleetState(stale, unvouched_warn_s=warn), interval_s=interval)
    await agg.start(bus)
    emb = Embedded(bus, agg, [Collector(cfg, bus) for cfg in configs])
    try:
        for c in emb.collectors:
            await c.start()
            await bus.subscribe_feedback(c.on_feedback)  # the miss split's levels, resyncs
            await bus.serve_overlap(c.info.collector_id, c.answer_overlap)
        if http is not None and http.listen:
            detail = any(c.aggregator.per_stream_detail for c in configs)
            ahead = min(c.aggregator.render_ahead_s for c in configs)
            emb.stop_http = await start_http(
                agg,
                http,
                otlp_endpoint=otlp_endpoint,
                per_stream_detail=detail,
                render_ahead_s=ahead,
            )
    except BaseException:
        await emb.close()
        raise
    return emb
