"""`kvobserve collect`: one node's collector, publishing snapshots to NATS, with its own local view."""

from __future__ import annotations

import argparse
import asyncio
import logging

from kvobserve.aggregator import Aggregator
from kvobserve.analysis.fleet import FleetState
from kvobserve.collector import Collector
from kvobserve.commands.common import Stop, fail, load, setup_logging, start_http, stop_event
from kvobserve.config import COLLECT_DEFAULTS, Config, ConfigError, add_config_flags
from kvobserve.transport import Transport
from kvobserve.transport.local import LocalBus

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvobserve collect` (nats.url is required, in the file, env or --nats)."""
    add_config_flags(parser, ("", "collector", "worker", "http", "nats"))
    parser.add_argument(
        "--no-local-http", action="store_true", help="do not serve the collector's own /metrics"
    )


def run(args: argparse.Namespace) -> int:
    """`kvobserve collect -c FILE --nats URL`: 2 on a bad setting, 1 when NATS is unreachable."""
    try:
        cfg = load(args, defaults=COLLECT_DEFAULTS)
        if cfg.nats is None:
            raise ConfigError("nats.url: required by `collect` (--nats URL or [nats] url)")
    except ConfigError as exc:
        return fail("collect", exc)
    setup_logging()
    return asyncio.run(_collect(cfg, local_http=not args.no_local_http))


async def _collect(cfg: Config, local_http: bool) -> int:
    from kvobserve.transport.nats import NatsConnectError, NatsTransport

    assert cfg.nats is not None
    stop = stop_event(
        "collect", "closing HTTP, the collector and the NATS connection (at most 2 s)"
    )
    transport = NatsTransport.from_config(
        cfg.nats, cfg.cluster, f"kvobserve-collector-{cfg.collector.id}"
    )
    try:
        await transport.connect()
    except NatsConnectError as exc:
        return fail("collect", exc, 1)
    local = Aggregator(FleetState())  # the node's own view: a fleet of one, fed directly
    collector = Collector(cfg, transport, observers=[local.apply])
    stop_http: Stop | None = None
    try:
        await collector.start()
        await transport.subscribe_feedback(collector.on_feedback)  # the miss split's levels
        await transport.serve_overlap(cfg.collector.id, collector.answer_overlap)
        if local_http and cfg.http.listen:
            # the node's own /api/v1/overlap asks this collector only, in process
            own = LocalBus()
            await own.serve_overlap(cfg.collector.id, collector.answer_overlap)
            try:
                stop_http = await start_http(local, cfg.http, transport=transport, overlap_via=own)
            except OSError as exc:
                log.warning("local /metrics not served: %s", exc)
        log.info("collector %s watching %d workers", cfg.collector.id, len(cfg.workers))
        await stop.wait()
    finally:
        await asyncio.wait_for(_shutdown(collector, transport, stop_http), 1.8)
    return 0


async def _shutdown(collector: Collector, transport: Transport, stop_http: Stop | None) -> None:
    if stop_http is not None:
        await stop_http()
    await collector.close()
    await transport.close()
