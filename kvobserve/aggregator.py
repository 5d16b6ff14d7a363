"""The fleet aggregator: snapshots from a transport -> FleetState; condition transitions -> events.

`Aggregator` is transport-agnostic (the embedded `kvobserve run` uses it with the in-process bus);
`kvobserve aggregate` (add_arguments/run below) wires it to NATS and the HTTP export.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.metrics_core import Metric

from kvobserve.analysis.fleet import Condition, FleetState, FleetView
from kvobserve.config import NatsConfig
from kvobserve.transport import Transport
from kvobserve.wire.errors import WireError
from kvobserve.wire.snapshot import decode_snapshot

log = logging.getLogger(__name__)

ConditionKey = tuple[str, tuple[tuple[str, str], ...]]


class Aggregator:
    """Applies collector snapshots to a FleetState and announces condition transitions."""

    def __init__(
        self, fleet: FleetState, clock: Callable[[], float] = time.time, interval_s: float = 1.0
    ) -> None:
        self.fleet = fleet
        self.clock = clock
        self.interval_s = interval_s
        # Self-metrics, read by the export layer.
        self.snapshots_received = 0
        self.decode_errors: dict[str, int] = {}  # WireError reason -> count
        self.transitions_total: dict[str, int] = {}  # "firing" / "resolved" -> count
        self._active: dict[ConditionKey, Condition] = {}
        self._transport: Transport | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def snapshots_applied(self) -> int:
        """Snapshots that replaced a collector's state."""
        return self.fleet.snapshots_applied

    @property
    def snapshots_ignored(self) -> int:
        """Snapshots older than the one held (reordered, replayed or from a dead process)."""
        return self.fleet.snapshots_ignored

    def stats(self) -> dict[str, Any]:
        """The self-metrics as one dict (a copy)."""
        return {
            "snapshots_received": self.snapshots_received,
            "snapshots_applied": self.snapshots_applied,
            "snapshots_ignored": self.snapshots_ignored,
            "decode_errors": dict(self.decode_errors),
            "transitions": dict(self.transitions_total),
        }

    def on_snapshot(self, data: bytes, received: float | None = None) -> None:
        """Decode and apply one snapshot; bad bytes are counted by reason, never raised.

        `received` is when the snapshot reached the bus (for ones read back from a store);
        default now. It is never taken as later than now.
        """
        self.snapshots_received += 1
        try:
            snap = decode_snapshot(data)
        except WireError as exc:
            self.decode_errors[exc.reason] = self.decode_errors.get(exc.reason, 0) + 1
            return
        except UnicodeDecodeError:  # msgspec's error for a str of invalid UTF-8; not msgpack
            self.decode_errors["msgpack"] = self.decode_errors.get("msgpack", 0) + 1
            return
        now = self.clock()
        self.fleet.update(snap, now if received is None else min(received, now))

    def view(self) -> FleetView:
        """The fleet as of now."""
        return self.fleet.view(self.clock())

    def transitions(self, view: FleetView) -> list[dict[str, Any]]:
        """Conditions that started or ended since the last call, as event dicts."""
        now = self.clock()
        current = {c.key: c for c in view.conditions}
        out: list[dict[str, Any]] = []
        for key, c in current.items():
            if key not in self._active:
                out.append(_event(c, "firing", now))
        for key, c in self._active.items():
            if key not in current:
                out.append(_event(c, "resolved", now))
        self._active = current
        return out

    async def check_conditions(self) -> None:
        """One tick: diff the conditions, log and publish the transitions."""
        for ev in self.transitions(self.view()):
            self.transitions_total[ev["state"]] = self.transitions_total.get(ev["state"], 0) + 1
            labels = " ".join(f"{k}={v}" for k, v in ev["labels"].items())
            log.info("condition %s: %s %s: %s", ev["state"], ev["kind"], labels, ev["description"])
            if self._transport is not None:
                await self._transport.publish_event(ev["kind"], json.dumps(ev).encode())

    async def start(self, transport: Transport) -> None:
        """Subscribe live, warm up from retained snapshots, start the condition task."""
        self._transport = transport
        await transport.subscribe_snapshots(self.on_snapshot)
        # Subscribing first leaves no window; a retained snapshot older than a live one is
        # simply ignored by FleetState (seq order).
        retained = await transport.retained_snapshots()
        for data, stored in retained:
            self.on_snapshot(data, stored)
        if retained:
            log.info("warm start: %d retained snapshots read", len(retained))
        self._task = asyncio.create_task(self._tick_loop())

    async def _tick_loop(self) -> None:
        """Check conditions every interval; a failing tick is logged, the loop goes on."""
        failed = False
        while True:
            try:
                await self.check_conditions()
                failed = False
            except Exception:
                if not failed:  # once per failure streak, not every second
                    log.exception("condition check failed")
                failed = True
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        """Stop the condition task; the transport belongs to the caller."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


def _event(c: Condition, state: str, now: float) -> dict[str, Any]:
    return {
        "kind": c.kind,
        "state": state,
        "severity": c.severity,
        "labels": dict(c.labels),
        "description": c.description,
        "time": now,
    }


@dataclass(frozen=True)
class AggregateOptions:
    """`kvobserve aggregate` flags, validated."""

    nats: NatsConfig
    cluster: str
    listen: str
    otlp_endpoint: str | None
    stale_intervals: float
    basic_auth: tuple[str, str] | None = None  # on every route but /healthz
    tls: tuple[str, str] | None = None  # (cert, key) files: serve HTTPS


# flag -> environment variable that provides its default (secrets stay out of `ps`).
_ENV = {
    "nats": "KVOBSERVE_NATS_URL",
    "cluster": "KVOBSERVE_CLUSTER",
    "listen": "KVOBSERVE_AGGREGATOR_LISTEN",
    "nats-user": "KVOBSERVE_NATS_USER",
    "nats-password": "KVOBSERVE_NATS_PASSWORD",
    "nats-token": "KVOBSERVE_NATS_TOKEN",
    "nats-creds": "KVOBSERVE_NATS_CREDS",
    "nats-tls-ca": "KVOBSERVE_NATS_TLS_CA",
    "nats-tls-cert": "KVOBSERVE_NATS_TLS_CERT",
    "nats-tls-key": "KVOBSERVE_NATS_TLS_KEY",
    "otlp-endpoint": "KVOBSERVE_AGGREGATOR_OTLP_ENDPOINT",
    "http-user": "KVOBSERVE_HTTP_USER",
    "http-password": "KVOBSERVE_HTTP_PASSWORD",
    "tls-cert": "KVOBSERVE_TLS_CERT",
    "tls-key": "KVOBSERVE_TLS_KEY",
}
_DEFAULTS = {"cluster": "default", "listen": "127.0.0.1:9477"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvobserve aggregate`."""
    for flag, env in _ENV.items():
        parser.add_argument(
            f"--{flag}",
            default=None,
            metavar=flag.rsplit("-", 1)[-1].upper(),
            help=f"(env {env}; default {_DEFAULTS.get(flag, 'none')})",
        )
    parser.add_argument(
        "--jetstream-kv",
        action="store_true",
        help="keep the last snapshot per collector in a JetStream KV bucket (warm restarts)",
    )
    parser.add_argument(
        "--stale-intervals",
        default="3",
        help="a collector silent for this many of its intervals is down (default 3)",
    )
    parser.add_argument(
        "--nats-connect-timeout",
        default="5",
        metavar="SECONDS",
        help="give up (exit 1) when NATS does not answer within this at start (default 5)",
    )


def _flag(args: argparse.Namespace, flag: str) -> str | None:
    value = getattr(args, flag.replace("-", "_"), None)
    if value is None:
        value = os.environ.get(_ENV[flag]) or _DEFAULTS.get(flag)
    return value


def _check_nats_url(value: str) -> str:
    for url in value.split(","):
        parts = urlsplit(url.strip())
        try:
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError:
            raise ValueError(f"--nats: bad port in {url.strip()!r}") from None
        if parts.scheme not in ("nats", "tls") or not parts.hostname:
            raise ValueError(f"--nats: expected nats://HOST:PORT or tls://HOST:PORT, got {value!r}")
    return value


def _check_listen(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535 or not host.strip("[]"):
        raise ValueError(f"--listen: expected HOST:PORT (port 0-65535), got {value!r}")
    return value


def _positive(value: str, flag: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = 0.0
    if not 0 < number < float("inf"):
        raise ValueError(f"{flag}: expected a number > 0, got {value!r}")
    return number


def options_from_args(args: argparse.Namespace) -> AggregateOptions:
    """Validate the flags; ValueError names the flag and the bad value."""
    from kvobserve.transport.nats import subject_token

    nats_url = _flag(args, "nats")
    if not nats_url:
        raise ValueError(f"--nats: required (or set {_ENV['nats']})")
    _check_nats_url(nats_url)
    cluster = _flag(args, "cluster") or ""
    if subject_token(cluster) != cluster:
        raise ValueError(f"--cluster: only letters, digits, '_' and '-' allowed, got {cluster!r}")
    listen = _check_listen(_flag(args, "listen") or "")
    user, password, token = (_flag(args, f) for f in ("nats-user", "nats-password", "nats-token"))
    creds = _flag(args, "nats-creds")
    if bool(user) != bool(password):
        raise ValueError("--nats-user/--nats-password: give both or neither")
    if token and (user or creds):
        raise ValueError("--nats-token: cannot be combined with --nats-user or --nats-creds")
    ca, cert, key = (_flag(args, f) for f in ("nats-tls-ca", "nats-tls-cert", "nats-tls-key"))
    if bool(cert) != bool(key):
        raise ValueError("--nats-tls-cert/--nats-tls-key: give both or neither")
    otlp = _flag(args, "otlp-endpoint")
    if otlp and urlsplit(otlp).scheme not in ("http", "https"):
        raise ValueError(f"--otlp-endpoint: expected an http(s):// URL, got {otlp!r}")
    stale = _positive(args.stale_intervals, "--stale-intervals")
    timeout = _positive(args.nats_connect_timeout, "--nats-connect-timeout")
    nats = NatsConfig(
        nats_url, user, password, token, creds, ca, cert, key, bool(args.jetstream_kv), timeout
    )
    http_user, http_password = _flag(args, "http-user"), _flag(args, "http-password")
    if bool(http_user) != bool(http_password):
        raise ValueError("--http-user/--http-password: give both or neither")
    tls_cert, tls_key = _flag(args, "tls-cert"), _flag(args, "tls-key")
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("--tls-cert/--tls-key: give both or neither")
    if tls_cert and tls_key:
        from kvobserve.export.server import make_ssl_context

        try:
            make_ssl_context(tls_cert, tls_key)  # unreadable files: a flag error, not a crash
        except ValueError as exc:
            raise ValueError(f"--tls-cert/--tls-key: {exc}") from None
    return AggregateOptions(
        nats,
        cluster,
        listen,
        otlp,
        stale,
        (http_user, http_password) if http_user and http_password else None,
        (tls_cert, tls_key) if tls_cert and tls_key else None,
    )


async def start_http(
    agg: Aggregator,
    listen: str,
    otlp_endpoint: str | None = None,
    otlp_interval_s: float = 10.0,
    nats: Transport | None = None,
    basic_auth: tuple[str, str] | None = None,
    tls: tuple[str, str] | None = None,
) -> Callable[[], Awaitable[None]]:
    """Serve /metrics, /healthz, /readyz, /api/v1/*, / for `agg.view` (and push OTLP when asked).

    Returns the async function that stops both.
    """
    from kvobserve.export import server
    from kvobserve.export.otlp import start_otlp
    from kvobserve.export.prometheus import aggregator_metrics

    def extra() -> list[Metric]:
        return aggregator_metrics(agg.fleet, agg.decode_errors, nats)

    app = server.create_app(agg.view, extra_metrics=extra, basic_auth=basic_auth)
    ssl_context = server.make_ssl_context(*tls) if tls else None
    http = await server.serve(app, listen, ssl_context)
    log.info("serving %s/metrics", http.url)
    push = (
        start_otlp(agg.view, otlp_endpoint, otlp_interval_s, extra=extra) if otlp_endpoint else None
    )

    async def stop() -> None:
        if push is not None:
            await push.shutdown()
        await http.close()

    return stop


async def serve(opts: AggregateOptions) -> int:
    """Connect, aggregate and serve until SIGTERM/SIGINT; then stop within 2 s."""
    from kvobserve.transport.nats import NatsConnectError, NatsTransport

    transport = NatsTransport.from_config(opts.nats, opts.cluster, "kvobserve-aggregator")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
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
        print(f"kvobserve aggregate: error: {exc}", file=sys.stderr)
        return 1
    agg = Aggregator(FleetState(stale_intervals=opts.stale_intervals))
    stop_http: Callable[[], Awaitable[None]] | None = None
    try:
        try:
            stop_http = await start_http(
                agg,
                opts.listen,
                opts.otlp_endpoint,
                nats=transport,
                basic_auth=opts.basic_auth,
                tls=opts.tls,
            )
        except OSError as exc:
            print(f"kvobserve aggregate: error: --listen: {exc.strerror or exc}", file=sys.stderr)
            return 1
        await agg.start(transport)
        log.info(
            "aggregating cluster %r from %s (jetstream_kv=%s); ready",
            opts.cluster, opts.nats.url, opts.nats.jetstream_kv,
        )  # fmt: skip
        await stop.wait()
        log.info("stopping")
    finally:
        await agg.stop()
        # Concurrently: each has its own ~1 s bound and SIGTERM must end the process within 2 s.
        closing = [transport.close()] + ([stop_http()] if stop_http is not None else [])
        await asyncio.gather(*closing, return_exceptions=True)
    return 0


def run(args: argparse.Namespace) -> int:
    """`kvobserve aggregate`: exit 2 on a bad flag, 1 when NATS is unreachable, 0 on a signal."""
    try:
        opts = options_from_args(args)
    except ValueError as exc:
        print(f"kvobserve aggregate: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return asyncio.run(serve(opts))
