"""`kvobserve tap --dynamo URL`: decode Dynamo event-plane envelopes, one JSON line per event batch.

URL `nats://…` (or `tls://…`) subscribes to Dynamo's KV-event subjects (`--namespace`, or
`--subject` for exact subjects); `tcp://…` or `ipc://…` is a ZMQ direct publisher. Each
RouterEvent is one batch, as the collector sees it (`seq = event_id - 1`), with its envelope.
`--all-topics` also prints `kv_metrics` (ActiveLoad) and forward-pass metrics. Bad messages go to
stderr as `{"error": reason, ...}`, like the engine mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import IO, Any

import msgspec
import zmq

from kvobserve.wire.dynamo import (
    DynamoMessage,
    decode_active_load,
    decode_fpm,
    decode_nats_message,
    decode_router_events,
    decode_zmq_message,
    to_batches,
)
from kvobserve.wire.dynamo_subject import DEFAULT_TOPICS, KV_EVENTS_TOPIC, subscription_subjects
from kvobserve.wire.errors import WireError
from kvobserve.wire.kv_events import DEFAULT_MAX_PAYLOAD, KvEvent

EXIT_USAGE = 2
_POLL_S = 0.1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The Dynamo input mode of `kvobserve tap`."""
    g = parser.add_argument_group("Dynamo event plane (instead of ENDPOINT)")
    g.add_argument(
        "--dynamo", metavar="URL", help="nats://HOST:PORT or a ZMQ direct tcp:// endpoint"
    )
    g.add_argument("--namespace", help="Dynamo namespace to subscribe to (default: all)")
    g.add_argument("--subject", action="append", help="exact NATS subject(s) instead")
    g.add_argument("--all-topics", action="store_true", help="also print kv_metrics and FPM")


def _event_view(ev: KvEvent) -> dict[str, Any]:
    out: dict[str, Any] = {"type": ev.kind}
    for name in ("block_hashes", "parent_block_hash", "medium", "block_size"):
        value = getattr(ev, name, None)
        if value is not None:
            out[name] = value
    return out


class _DynamoTap:
    """Decodes and prints; counts what it printed."""

    def __init__(self, args: argparse.Namespace, out: IO[str]) -> None:
        self.count: int | None = args.count
        self.all_topics: bool = args.all_topics
        self.max_payload: int = getattr(args, "max_payload", DEFAULT_MAX_PAYLOAD)
        self.out = out
        self.printed = 0
        self.stop = False

    @property
    def done(self) -> bool:
        """--count lines printed, or a stop signal."""
        return self.stop or (self.count is not None and self.printed >= self.count)

    def _print(self, obj: dict[str, Any]) -> None:
        if self.done:
            return
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()
        self.printed += 1

    def handle(self, where: dict[str, Any], decode: Any) -> None:
        """Decode one message (`decode()` gives the DynamoMessage) and print its batches."""
        try:
            msg: DynamoMessage = decode()
            env = {
                **where,
                "topic": msg.topic,
                "publisher_id": msg.publisher_id,
                "sequence": msg.sequence,
                "published_at": None if msg.published_at_ms is None else msg.published_at_ms / 1000,
            }
            if msg.topic == KV_EVENTS_TOPIC:
                events = decode_router_events(msg)
                tiers = {
                    (e.worker_id, e.event.dp_rank, e.event.event_id): e.tier for e in events.events
                }
                ts = env["published_at"] or time.time()
                for (wid, rank), batch, _ in to_batches(events, ts):
                    self._print(
                        {
                            **env,
                            "worker_id": wid,
                            "dp_rank": rank,
                            "event_id": batch.seq + 1,
                            "seq": batch.seq,
                            "storage_tier": tiers.get((wid, rank, batch.seq + 1)),
                            "events": [_event_view(e) for e in batch.events],
                        }
                    )
            elif self.all_topics:
                body = decode_active_load(msg) if msg.topic == "kv_metrics" else decode_fpm(msg)
                self._print({**env, "load": msgspec.to_builtins(body)})
        except WireError as exc:
            err = {"error": exc.reason, "detail": str(exc), **where}
            sys.stderr.write(json.dumps(err) + "\n")
            sys.stderr.flush()


async def _run_nats(args: argparse.Namespace, tap: _DynamoTap) -> int:
    import nats
    import nats.errors

    topics = DEFAULT_TOPICS if args.all_topics else (KV_EVENTS_TOPIC,)
    subjects = args.subject or subscription_subjects(args.namespace, topics, legacy=True)
    try:
        nc = await nats.connect(args.dynamo, connect_timeout=5, max_reconnect_attempts=0)
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        return _fail(f"cannot connect to {args.dynamo}: {exc}", 1)
    last = time.monotonic()

    async def on_msg(m: Any) -> None:
        nonlocal last
        last = time.monotonic()
        where = {"subject": m.subject}
        tap.handle(where, lambda: decode_nats_message(m.subject, m.data, tap.max_payload))

    try:
        for s in subjects:
            await nc.subscribe(s, cb=on_msg)
        await nc.flush()
        while not tap.done:
            await asyncio.sleep(_POLL_S)
            if args.timeout is not None and time.monotonic() - last >= args.timeout:
                break
    finally:
        await nc.close()
    return 1 if args.count is not None and tap.printed < args.count and not tap.stop else 0


def _run_zmq(args: argparse.Namespace, tap: _DynamoTap) -> int:
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            sub.connect(args.dynamo)
        except zmq.ZMQError as exc:
            return _fail(f"bad endpoint {args.dynamo!r}: {exc}")
        last = time.monotonic()
        where = {"endpoint": args.dynamo}
        while not tap.done:
            if sub.poll(int(_POLL_S * 1000)):
                frames: Sequence[bytes] = sub.recv_multipart()
                last = time.monotonic()
                tap.handle(where, lambda f=frames: decode_zmq_message(f, tap.max_payload))
            elif args.timeout is not None and time.monotonic() - last >= args.timeout:
                break
    finally:
        ctx.destroy(linger=0)
    return 1 if args.count is not None and tap.printed < args.count and not tap.stop else 0


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    sys.stderr.write(f"kvobserve tap: {message}\n")
    return code


def run_dynamo(args: argparse.Namespace) -> int:
    """`kvobserve tap --dynamo URL`: 0 on success, 1 on --count not reached, 2 on bad usage."""
    url: str = args.dynamo
    scheme = url.partition("://")[0]
    if args.endpoint or args.file or args.replay_endpoint or args.record or args.topic:
        return _fail("--dynamo takes no ENDPOINT, --file, --replay-endpoint, --record or --topic")
    if scheme not in ("nats", "tls", "tcp", "ipc") or "://" not in url:
        return _fail(f"bad --dynamo {url!r}: expected nats://HOST:PORT or tcp://HOST:PORT")
    if scheme in ("tcp", "ipc") and (args.subject or args.namespace):
        return _fail("--subject and --namespace are for NATS; a ZMQ publisher sends every topic")
    tap = _DynamoTap(args, sys.stdout)

    def on_signal(signum: int, frame: Any) -> None:
        tap.stop = True

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, on_signal)
        except ValueError:  # not the main thread
            break
    try:
        if scheme in ("nats", "tls"):
            return asyncio.run(_run_nats(args, tap))
        return _run_zmq(args, tap)
    except BrokenPipeError:  # `… | head` closed our stdout: exit quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
