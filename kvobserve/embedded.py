"""`kvobserve run -c FILE`: one machine, one process — collector, aggregator and HTTP, no NATS."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvobserve.aggregator import Aggregator, start_http
from kvobserve.analysis.fleet import FleetState
from kvobserve.collector import Collector
from kvobserve.config import Config, ConfigError, add_config_flags, load_config, overrides_from_args
from kvobserve.transport.local import LocalBus

log = logging.getLogger(__name__)


@dataclass
class Embedded:
    """Collectors and an aggregator joined by the in-process bus, plus the HTTP server."""

    bus: LocalBus
    aggregator: Aggregator
    collectors: list[Collector]
    stop_http: Callable[[], Awaitable[None]] | None = None

    async def close(self) -> None:
        """Stop HTTP, collectors, the aggregator and the bus; idempotent."""
        if self.stop_http is not None:
            await self.stop_http()
            self.stop_http = None
        await asyncio.gather(*(c.close() for c in self.collectors))
        await self.aggregator.stop()
        await self.bus.close()


async def start_embedded(
    configs: list[Config], listen: str | None, otlp_endpoint: str | None = None
) -> Embedded:
    """Start one collector per config and the aggregator on one LocalBus; serve on `listen`."""
    bus = LocalBus()
    interval = min((c.collector.interval_s for c in configs), default=1.0)
    # [aggregator] stale_intervals holds here as in `kvobserve aggregate`; the strictest one wins
    stale = min((c.aggregator.stale_intervals for c in configs), default=3)
    agg = Aggregator(FleetState(stale_intervals=stale), interval_s=interval)
    await agg.start(bus)
    emb = Embedded(bus, agg, [Collector(cfg, bus) for cfg in configs])
    try:
        for c in emb.collectors:
            await c.start()
        if listen:
            emb.stop_http = await start_http(agg, listen, otlp_endpoint)
    except BaseException:
        await emb.close()
        raise
    return emb


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvobserve run`: the config flags; -c is required."""
    add_config_flags(parser, require_config=True)


def run(args: argparse.Namespace) -> int:
    """`kvobserve run -c FILE`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        cfg = load_config(args.config, overrides_from_args(args), os.environ)
    except ConfigError as exc:
        print(f"kvobserve run: {exc}", flush=True)
        return 2
    return asyncio.run(_run(cfg))


async def _run(cfg: Config) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        emb = await start_embedded([cfg], cfg.aggregator.listen, cfg.aggregator.otlp_endpoint)
    except OSError as exc:
        print(f"kvobserve run: aggregator.listen {cfg.aggregator.listen}: {exc}", flush=True)
        return 1
    print(f"kvobserve: /metrics and status page on http://{cfg.aggregator.listen}/", flush=True)
    await stop.wait()
    await asyncio.wait_for(emb.close(), 1.8)
    return 0
