"""`kvobserve tap`: decode a live KV-event stream (or a recorded frames.jsonl), one JSON line per batch.

A live stream is a publisher tap connects to (ENDPOINT), or with --bind an endpoint tap binds for
publishers that connect (vLLM given a concrete host, llm-d's central mode); their batches are
told apart by the topic each line carries.

With --requests each line is one request instead of one batch: the batch's BlockStored events
split by their parent chains (commands/tap_requests.py), for `kvobserve overlap`.

Exit 0 when batches were printed (and --count reached), 1 with one line on stderr when nothing
usable came (and why: commands/tap_live.py), 2 on a bad endpoint, file or flag.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import IO, Any

import zmq

from kvobserve.commands import tap_dynamo
from kvobserve.commands.tap_live import POLL_MS, watch_live
from kvobserve.commands.tap_requests import Requests
from kvobserve.config.bind import bind_host_problem
from kvobserve.sources.link import MONITOR_EVENTS
from kvobserve.sources.relay import bind_endpoint
from kvobserve.wire.errors import WireError
from kvobserve.wire.kv_events import DEFAULT_MAX_PAYLOAD, KvBatch, decode_message
from kvobserve.wire.kv_view import batch_view
from kvobserve.wire.replay import decode_replay_message, encode_replay_request, is_end_marker

EXIT_USAGE = 2
DEFAULT_REPLAY_WAIT_S = 5.0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvobserve tap`."""
    parser.add_argument("endpoint", nargs="?", help="publisher to SUB to, e.g. tcp://10.0.0.5:5557")
    parser.add_argument("--file", help="decode a recorded frames.jsonl instead of a live stream")
    parser.add_argument(
        "--bind",
        metavar="ENDPOINT",
        help="bind ENDPOINT (e.g. tcp://*:5557) and receive from the publishers that connect "
        "to it, instead of connecting to one",
    )
    parser.add_argument("--topic", help="subscription topic prefix (default: all topics)")
    parser.add_argument("--replay-endpoint", help="replay ROUTER to ask first (DEALER request)")
    parser.add_argument(
        "--from-seq", type=int, default=None, help="first seq to replay (default 0)"
    )
    parser.add_argument("--token-ids", action="store_true", help="include the token ids")
    parser.add_argument(
        "--requests",
        action="store_true",
        help="one line per request instead of per batch: a batch's BlockStored events split "
        "by parent chains, each request's block hashes from its first block as far as seen "
        "(--count counts requests); for `kvobserve overlap`",
    )
    parser.add_argument("--record", metavar="F", help="also write every message received to F")
    parser.add_argument(
        "--count",
        type=_positive_int,
        metavar="N",
        help="stop after N batches (requests with --requests)",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        metavar="S",
        help="stop after S seconds without a batch (exit 1 if none came or --count was not reached)",
    )
    parser.add_argument(
        "--max-payload", type=_positive_int, default=DEFAULT_MAX_PAYLOAD, help=argparse.SUPPRESS
    )
    tap_dynamo.add_arguments(parser)  # Dynamo's event plane: a separate input mode


def endpoint_problem(endpoint: str, bind: bool = False) -> str | None:
    """Why `endpoint` cannot be connected to (`bind`: bound), or None when it looks valid."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return "expected tcp://HOST:PORT, ipc://PATH or inproc://NAME"
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host:
            return "expected tcp://HOST:PORT"
        if host == "*" and not bind:
            return (
                "a wildcard host only binds; tap connects: give the engine's address "
                "(or --bind, for publishers that connect)"
            )
        if not port.isdigit() or not 0 < int(port) < 65536:
            return f"port {port!r} is not a number in 1..65535"
        return bind_host_problem(endpoint) if bind else None
    if scheme in ("ipc", "inproc"):
        return None if rest else f"empty {scheme} address"
    return f"unknown transport {scheme!r} (expected tcp, ipc or inproc)"


def _fail(message: str) -> int:
    sys.stderr.write(f"kvobserve tap: {message}\n")
    return EXIT_USAGE


class _Tap:
    """Decodes messages, prints batches, reports bad messages, records frames, counts."""

    def __init__(self, args: argparse.Namespace, out: IO[str], record: IO[str] | None) -> None:
        self.token_ids: bool = args.token_ids
        self.requests = Requests() if args.requests else None
        self.count: int | None = args.count
        self.max_payload: int = args.max_payload
        self.out = out
        self.record = record
        self.printed = 0
        self.stop = False
        self.last_error = ""

    @property
    def done(self) -> bool:
        """True once --count batches were printed or a stop signal arrived."""
        return self.stop or (self.count is not None and self.printed >= self.count)

    def handle(
        self, frames: Sequence[bytes], source: str, topic: str, where: str
    ) -> KvBatch | None:
        """Decode and print one message; None for replay end markers and bad messages."""
        if self.record is not None:
            line = {
                "source": source,
                "dp_rank": None,
                "port_offset": None,
                "frames": [base64.b64encode(f).decode("ascii") for f in frames],
            }
            self.record.write(json.dumps(line) + "\n")
            self.record.flush()
        try:
            if source == "replay":
                batch = decode_replay_message(frames, topic, self.max_payload)
            else:
                batch = decode_message(frames, self.max_payload)
            # the view decodes every field the hot path skipped: it can fail here too
            view = None if batch is None else batch_view(batch, frames[-1], self.token_ids)
            text = None if view is None else json.dumps(view)
        except WireError as exc:
            self.last_error = exc.reason
            err = {"error": exc.reason, "detail": str(exc), "source": source, "at": where}
            sys.stderr.write(json.dumps(err) + "\n")
            sys.stderr.flush()
            return None
        if view is not None and self.requests is not None:
            self._print_requests(view)
        elif text is not None:
            self.out.write(text + "\n")
            self.out.flush()
            self.printed += 1
        return batch

    def _print_requests(self, view: dict[str, Any]) -> None:
        """One line per request of the batch: the batch's fields, then the request's."""
        assert self.requests is not None
        head = {k: view[k] for k in ("topic", "seq", "dp_rank", "ts")}
        for req in self.requests.split(view["events"]):
            if self.done:
                return
            self.out.write(json.dumps({**head, **req.json()}) + "\n")
            self.out.flush()
            self.printed += 1


class BadFile(Exception):
    """A frames.jsonl line that is not a recorded message."""


def _read_frames_file(f: IO[str]) -> Iterator[tuple[int, str, int | None, list[bytes]]]:
    """(line number, source, dp_rank, frames) per line of a frames.jsonl."""
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            raise BadFile(f"line {lineno}: not JSON") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("frames"), list):
            raise BadFile(f"line {lineno}: no 'frames' list")
        source = obj.get("source", "live")
        if source not in ("live", "replay"):
            raise BadFile(f"line {lineno}: source {source!r} is not 'live' or 'replay'")
        rank = obj.get("dp_rank")
        try:
            frames = [base64.b64decode(s, validate=True) for s in obj["frames"]]
        except (TypeError, binascii.Error):
            raise BadFile(f"line {lineno}: frames are not base64 strings") from None
        yield lineno, source, rank if isinstance(rank, int) else None, frames


def _run_file(args: argparse.Namespace, tap: _Tap) -> int:
    path: str = args.file
    # a 3-frame replay reply has no topic: take the one the same rank's live messages carried
    live_topic: dict[int | None, str] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, source, rank, frames in _read_frames_file(f):
                if tap.done:
                    break
                topic = args.topic
                if topic is None:
                    topic = live_topic.get(rank, live_topic.get(None, ""))
                batch = tap.handle(frames, source, topic, f"{path}:{lineno}")
                if batch is not None and source == "live":
                    live_topic[rank] = live_topic[None] = batch.topic
    except OSError as exc:
        return _fail(f"cannot read file {path!r}: {exc.strerror or exc}")
    except UnicodeDecodeError:
        return _fail(f"bad file {path!r}: not UTF-8 text")
    except BadFile as exc:
        return _fail(f"bad file {path!r}: {exc}")
    return 0


def _recv(sock: zmq.Socket[bytes], tap: _Tap, wait_s: float | None) -> list[bytes] | None:
    """The next message, or None on a stop signal or after `wait_s` idle seconds."""
    deadline = None if wait_s is None else time.monotonic() + wait_s
    while not tap.stop:
        if sock.poll(POLL_MS):
            return sock.recv_multipart()
        if deadline is not None and time.monotonic() >= deadline:
            return None
    return None


def _run_bound(args: argparse.Namespace, tap: _Tap) -> int:
    """--bind: one SUB bound at the endpoint, every publisher that connects."""
    topic: str = args.topic or ""
    ctx = zmq.Context()
    try:
        bound = bind_endpoint(ctx, args.bind, 100_000, None)
        if isinstance(bound, str):
            sys.stderr.write(f"kvobserve tap: {bound}\n")
            return 1
        sub, mon = bound
        where = sub.getsockopt_string(zmq.LAST_ENDPOINT)
        sys.stderr.write(f"kvobserve tap: listening on {where}; publishers connect here\n")
        outcome = watch_live(sub, mon, tap, args.bind, topic, args.timeout, bound=True)
        sub.disable_monitor()
    finally:
        ctx.destroy(linger=0)
    return _ended(args, tap, outcome.ok, outcome.message, f"on {args.bind}")


def _ended(args: argparse.Namespace, tap: _Tap, ok: bool, message: str, where: str) -> int:
    """The exit status of a live tap, with its one line on stderr when it failed."""
    if not ok:
        sys.stderr.write(f"kvobserve tap: {message}\n")
        return 1
    if args.count is not None and tap.printed < args.count and not tap.stop:
        what = "requests" if args.requests else "batches"
        sys.stderr.write(
            f"kvobserve tap: {tap.printed} of {args.count} {what} {where}, then nothing for "
            f"{args.timeout:g} s\n"
        )
        return 1
    return 0


def _run_live(args: argparse.Namespace, tap: _Tap) -> int:
    topic: str = args.topic or ""
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        mon = sub.get_monitor_socket(MONITOR_EVENTS)
        try:
            sub.connect(args.endpoint)
        except zmq.ZMQError as exc:
            return _fail(f"bad endpoint {args.endpoint!r}: {exc}")
        if args.replay_endpoint:
            # SUB is connected first, so live batches sent during the replay wait in its queue
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            try:
                dealer.connect(args.replay_endpoint)
            except zmq.ZMQError as exc:
                return _fail(f"bad replay endpoint {args.replay_endpoint!r}: {exc}")
            dealer.send_multipart(encode_replay_request(args.from_seq or 0))
            wait = args.timeout or DEFAULT_REPLAY_WAIT_S
            while not tap.done:
                frames = _recv(dealer, tap, wait)
                if frames is None:
                    if not tap.stop:
                        err = {"error": "replay_timeout", "endpoint": args.replay_endpoint}
                        sys.stderr.write(json.dumps(err) + "\n")
                    break
                tap.handle(frames, "replay", topic, args.replay_endpoint)
                if is_end_marker(frames):
                    break
            dealer.close(linger=0)
        outcome = watch_live(sub, mon, tap, args.endpoint, topic, args.timeout)
    finally:
        ctx.destroy(linger=0)
    return _ended(args, tap, outcome.ok, outcome.message, f"from {args.endpoint}")


def run(args: argparse.Namespace) -> int:
    """Run `kvobserve tap`; 0 on success, 2 on a bad endpoint, file or flag."""
    if args.dynamo is not None:
        if args.requests:
            return _fail("--requests splits the batches of ENDPOINT, --bind or --file")
        return tap_dynamo.run_dynamo(args)
    if [args.file, args.endpoint, args.bind].count(None) != 2:
        return _fail("give exactly one of ENDPOINT, --bind ENDPOINT or --file")
    if args.replay_endpoint and args.endpoint is None:
        return _fail(
            "--replay-endpoint asks one publisher: give it with ENDPOINT, not --file or --bind"
        )
    if args.from_seq is not None and not args.replay_endpoint:
        return _fail("--from-seq needs --replay-endpoint")
    if args.from_seq is not None and not 0 <= args.from_seq < 2**64 - 1:
        return _fail(f"--from-seq {args.from_seq} is out of range 0..2^64-2")
    for flag, ep in (("endpoint", args.endpoint), ("replay endpoint", args.replay_endpoint)):
        problem = endpoint_problem(ep) if ep else None
        if problem:
            return _fail(f"bad {flag} {ep!r}: {problem}")
    if args.bind is not None and (problem := endpoint_problem(args.bind, bind=True)):
        return _fail(f"bad --bind {args.bind!r}: {problem}")
    record: IO[str] | None = None
    if args.record:
        try:
            record = open(args.record, "w", encoding="utf-8")  # noqa: SIM115 - closed below
        except OSError as exc:
            return _fail(f"cannot write record file {args.record!r}: {exc.strerror or exc}")
    tap = _Tap(args, sys.stdout, record)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        tap.stop = True

    previous: dict[int, Any] = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                previous[sig] = signal.signal(sig, on_signal)
            except ValueError:  # not the main thread: leave signals alone
                break
        if args.file is not None:
            return _run_file(args, tap)
        return _run_bound(args, tap) if args.bind is not None else _run_live(args, tap)
    except BrokenPipeError:
        # `kvobserve tap … | head` closed our stdout: point it at devnull so exit is quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if record is not None:
            record.close()
