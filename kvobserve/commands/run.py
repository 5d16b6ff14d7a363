"""`kvobserve run`: one machine, one process: collector, aggregator and HTTP, no NATS."""

from __future__ import annotations

import argparse
import asyncio

from kvobserve.commands.common import fail, load, setup_logging, stop_event
from kvobserve.commands.embedded import start_embedded
from kvobserve.config import Config, ConfigError, add_config_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvobserve run`: the config flags (a file is optional)."""
    add_config_flags(parser, ("", "collector", "worker", "aggregator", "http"))


def run(args: argparse.Namespace) -> int:
    """`kvobserve run [-c FILE] [flags]`: 2 on a bad setting, 1 when it cannot listen."""
    try:
        cfg = load(args)
    except ConfigError as exc:
        return fail("run", exc)
    if not cfg.workers:
        return fail("run", "no [[worker]] to watch (give -c FILE or --engine/--kv-endpoint)")
    setup_logging()
    return asyncio.run(_run(cfg))


async def _run(cfg: Config) -> int:
    n = len(cfg.workers)
    closing = f"closing HTTP, the collector ({n} worker{'s' if n > 1 else ''}) and the aggregator"
    stop = stop_event("run", f"{closing} (at most 2 s)")
    try:
        emb = await start_embedded([cfg], cfg.http, cfg.aggregator.otlp_endpoint)
    except OSError as exc:
        return fail("run", f"http.listen {cfg.http.listen}: {exc.strerror or exc}", 1)
    scheme = "https" if cfg.http.tls else "http"
    print(f"kvobserve: /metrics and status page on {scheme}://{cfg.http.listen}/", flush=True)
    await stop.wait()
    await asyncio.wait_for(emb.close(), 1.8)
    return 0
