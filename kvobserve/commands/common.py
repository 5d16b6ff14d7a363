"""What the commands share: the configuration, logging, stop signals and the HTTP side."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from prometheus_client.metrics_core import Metric

from kvobserve.aggregator import Aggregator
from kvobserve.config import (
    Config,
    HttpConfig,
    load_config,
    overrides_from_args,
)
from kvobserve.transport import Transport

log = logging.getLogger(__name__)
Stop = Callable[[], Awaitable[None]]


def fail(command: str, message: object, code: int = 2) -> int:
    """Print one line `kvobserve COMMAND: error: ...` on stderr; return the exit code."""
    text = str(message).replace("\n", " ")
    print(f"kvobserve {command}: error: {text}", file=sys.stderr, flush=True)
    return code


def load(args: argparse.Namespace, defaults: Mapping[str, Any] | None = None) -> Config:
    """The configuration from `-c`, KVOBSERVE_* and the flags; ConfigError names the setting."""
    return load_config(args.config, overrides_from_args(args), os.environ, defaults=defaults)


def setup_logging() -> None:
    """One log format for every daemon command."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # the Kubernetes client's HTTP library logs every request (each watch) at INFO
    logging.getLogger("httpx2").setLevel(logging.WARNING)


def stop_event(command: str = "", stopping: str = "") -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (call inside the running loop). The first signal is
    logged once, on `command`'s logger, with what the command does now (`stopping`)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    logger = logging.getLogger(f"kvobserve.commands.{command}" if command else __name__)

    def on_signal(sig: signal.Signals) -> None:
        if not stop.is_set():
            logger.info("%s: stopping%s", sig.name, f": {stopping}" if stopping else "")
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    return stop


async def start_http(
    agg: Aggregator,
    http: HttpConfig,
    *,
    otlp_endpoint: str | None = None,
    otlp_interval_s: float = 10.0,
    transport: Transport | None = None,
    per_stream_detail: bool = False,
    shard: str = "",
    render_ahead_s: float = 2.0,
    overlap_via: Transport | None = None,
) -> Stop:
    """Serve `agg` on [http] listen (and push OTLP when asked); returns the function that stops both.

    /api/v1/overlap asks the collectors through `overlap_via`, default the transport `agg` was
    started with; an aggregator started with none (`collect`'s own view) serves it only with one.
    """
    from kvobserve.export import server
    from kvobserve.export.otlp import OtlpPush
    from kvobserve.export.prometheus import aggregator_metrics

    def extra() -> list[Metric]:
        return aggregator_metrics(agg.fleet, agg.decode_errors, transport, shard)

    app = server.create_app(
        agg.view,
        extra_metrics=extra,
        basic_auth=http.basic_auth,
        per_stream_detail=per_stream_detail,
        events=lambda: list(agg.events),
        runbook_url=http.runbook_url,
        shard=shard,
        render_ahead_s=render_ahead_s,
        overlap=functools.partial(agg.overlap, via=overlap_via),
    )
    tls = server.make_ssl_context(*http.tls) if http.tls else None
    served = await server.serve(app, http.listen, tls)
    log.info("serving %s/metrics", served.url)
    push = (
        OtlpPush(agg.view, otlp_endpoint, otlp_interval_s, extra=extra).start()
        if otlp_endpoint
        else None
    )

    async def stop() -> None:
        if push is not None:
            await push.shutdown()
        await served.close()

    return stop
