"""`kvobserve aggregate`: the fleet aggregator over NATS: one /metrics, the API, the status page."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging

from kvobserve.aggregator import Aggregator, tune_runtime
from kvobserve.analysis.fleet import FleetState
from kvobserve.commands.common import Stop, fail, load, setup_logging, start_http, stop_event
from kvobserve.config import Config, ConfigError, add_config_flags

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvobserve aggregate` (nats.url is required, in the file, env or --nats)."""
    add_config_flags(parser, ("", "aggregator", "http", "nats"))


def run(args: argparse.Namespace) -> int:
    """Exit 2 on a bad setting, 1 when NATS is unreachable or it cannot listen, 0 on a signal."""
    try:
        cfg = load(args)
        if cfg.nats is None:
            raise ConfigError("nats.url: required by `aggregate` (--nats URL or [nats] url)")
    except ConfigError as exc:
        return fail("aggregate", exc)
    setup_logging()
    return asyncio.run(serve(cfg))


async def serve(cfg: Config) -> int:
    """Connect, aggregate and serve until SIGTERM/SIGINT; then stop within 2 s."""
    from kvobserve.transport.nats import NatsConnectError, NatsTransport

    assert cfg.nats is not None
    stop = stop_event("aggregate", "closing HTTP and the NATS connection (at most 2 s)")
    a = cfg.aggregator
    transport = NatsTransport.from_config(
        cfg.nats, cfg.cluster, "kvobserve-aggregator", a.shard, a.shards
    )
    connecting = asyncio.ensure_future(transport.connect())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not connecting.done():  # a signal during the first connect ends the process at once
        connecting.cancel()
        with contextlib.suppress(asyncio.CancelledError, NatsConnectError):
            await connecting
        await transport.close()
        return 0
    try:
        connecting.result()
    except NatsConnectError as exc:
        return fail("aggregate", exc, 1)
    a = cfg.aggregator
    agg = Aggregator(FleetState(a.stale_intervals, unvouched_warn_s=a.unvouched_warn_s))
    stop_http: Stop | None = None
    try:
        try:
            stop_http = await start_http(
                agg,
                cfg.http,
                otlp_endpoint=cfg.aggregator.otlp_endpoint,
                transport=transport,
                per_stream_detail=cfg.aggregator.per_stream_detail,
                shard=str(a.shard) if a.shards > 1 else "",
                render_ahead_s=a.render_ahead_s,
            )
        except OSError as exc:
            return fail("aggregate", f"http.listen {cfg.http.listen}: {exc.strerror or exc}", 1)
        await agg.start(transport)
        tune_runtime()
        log.info(
            "aggregating cluster %r from %s (shard %d of %d, jetstream_kv=%s); ready",
            cfg.cluster, cfg.nats.url, a.shard, a.shards, cfg.nats.jetstream_kv,
        )  # fmt: skip
        await stop.wait()
    finally:
        await agg.stop()
        # Concurrently: each has its own ~1 s bound and SIGTERM must end the process within 2 s.
        closing = [transport.close()] + ([stop_http()] if stop_http is not None else [])
        await asyncio.gather(*closing, return_exceptions=True)
    return 0
