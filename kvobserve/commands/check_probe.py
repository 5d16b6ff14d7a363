"""`kvobserve check --probe`: connect to every endpoint and URL of the plans for a few seconds.

Each KV-event endpoint (every rank, the probe ports past the last rank, the replay ROUTERs) gets
a SUB with an empty prefix (a DEALER for replay) and a socket monitor feeding the collector's Link
(sources/link.py), so the verdicts and reasons are the collector's; each scheduler metrics URL is
fetched once. What was seen is reported per rank: batches, topics, event shape, rank labels.

In bind mode the probe binds each bound endpoint as the collector would (so it fails while the
collector, or anything else, holds it) and counts the publishers that connect; a `relay_to`
target gets an XPUB that connects and sees whether the target subscribes, as the relay needs.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvobserve.sources.health import UP_STATES, Health
from kvobserve.sources.link import MONITOR_EVENTS, Link, LinkTimes
from kvobserve.sources.periodic import http_failure_reason, http_status_reason
from kvobserve.sources.relay import bind_endpoint, count_peers, nobody_connected
from kvobserve.wire.errors import WireError
from kvobserve.wire.kv_events import decode_message


@dataclass
class Found:
    """What one endpoint showed during the probe."""

    role: str  # stream, probe (a port past the last rank), replay, metrics, bound, relay
    worker_id: str
    dp_rank: int | None
    endpoint: str
    topic: str = ""  # the configured topic (streams)
    state: str = "connecting"
    reason: str = "connecting"
    batches: int = 0
    topics: Counter[str] = field(default_factory=Counter)
    shapes: set[str] = field(default_factory=set)
    rank_labels: set[int] = field(default_factory=set)
    errors: Counter[str] = field(default_factory=Counter)
    publishers: int = 0  # bound: connected at the end of the probe

    @property
    def ok(self) -> bool:
        """Fine for its role: a stream or replay connected, a probe port silent, a URL answering,
        publishers connected to a bound endpoint, a relay target subscribed."""
        if self.role == "probe":
            return self.batches == 0
        if self.role in ("bound", "relay"):
            return self.state in ("connected", "up")
        return self.state in UP_STATES

    def summary(self) -> str:
        """One line: the verdict and what was seen."""
        if self.role == "probe":
            if self.batches:
                return f"KV events here ({self.batches} batches): dp_size too small?"
            return "nothing publishes here (as expected)"
        if self.role == "replay":
            return "reachable" if self.ok else f"{self.state}: {self.reason}"
        if self.role in ("metrics", "relay"):
            return f"{self.state}: {self.reason}"
        parts = [f"{self.state}: {self.reason}"]
        if self.batches:
            parts.append(f"{self.batches} batches")
        if self.topics:
            shown = sorted(self.topics)
            more = f" and {len(shown) - 3} more" if len(shown) > 3 else ""
            parts.append("topic " + ", ".join(repr(t) for t in shown[:3]) + more)
        if self.shapes:
            parts.append("events as tagged " + "/".join(sorted(self.shapes)))
        if self.rank_labels:
            parts.append("rank label " + ",".join(str(r) for r in sorted(self.rank_labels)))
        if self.errors:
            parts.append("undecodable: " + ", ".join(f"{r} x{n}" for r, n in self.errors.items()))
        return "; ".join(parts)

    def json(self) -> dict[str, Any]:
        """The JSON form `check --probe --json` prints."""
        return {
            "role": self.role,
            "dp_rank": self.dp_rank,
            "endpoint": self.endpoint,
            "ok": self.ok,
            "state": self.state,
            "reason": self.reason,
            "batches": self.batches,
            "topics": dict(self.topics),
            "event_shapes": sorted(self.shapes),
            "rank_labels": sorted(self.rank_labels),
            "decode_errors": dict(self.errors),
            **({"publishers": self.publishers} if self.role == "bound" else {}),
        }


def _shape(payload: bytes) -> str | None:
    try:
        events = msgspec.msgpack.decode(payload)[1]
    except (msgspec.DecodeError, IndexError, TypeError, KeyError):
        return None
    if events and isinstance(events[0], dict):
        return "maps"
    return "arrays" if events and isinstance(events[0], list) else None


def _note(f: Found, frames: list[bytes]) -> str:
    """Count one message: "good" (a batch under the topic), "bad" (undecodable) or "other"."""
    if f.role in ("replay", "relay"):
        return "other"
    try:
        batch = decode_message(frames)
    except WireError as exc:
        f.errors[exc.reason] += 1
        return "bad"
    f.topics[batch.topic] += 1
    if f.topic and not batch.topic.startswith(f.topic):
        return "other"  # not what the collector would see with its prefix
    f.batches += 1
    if batch.dp_rank is not None:
        f.rank_labels.add(batch.dp_rank)
    if len(f.shapes) < 2 and (shape := _shape(frames[2])) is not None:
        f.shapes.add(shape)
    return "good"


_SOCKET = {"replay": zmq.DEALER, "relay": zmq.XPUB}  # the rest: SUB


def probe_zmq(found: list[Found], seconds: float) -> None:
    """Connect to (or bind) every ZMQ endpoint of `found` at once and watch for `seconds`."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        poller = zmq.Poller()
        socks: dict[zmq.Socket[bytes], tuple[Found, Link]] = {}
        mons: dict[zmq.Socket[bytes], Link] = {}
        peers: dict[zmq.Socket[bytes], tuple[Found, set[int]]] = {}  # bound: monitor -> fds
        for f in found:
            if f.role == "bound":
                bound = bind_endpoint(ctx, f.endpoint, 100_000, None)
                if isinstance(bound, str):
                    f.state, f.reason = "bind_failed", bound
                    continue
                sock, mon = bound
                peers[mon] = (f, set())
                health = Health("", "listening", "", 0.0)  # the word is _bound_verdict's
                socks[sock] = (f, Link(f.endpoint, "", health, LinkTimes(), bound=True))
                poller.register(sock, zmq.POLLIN)
                poller.register(mon, zmq.POLLIN)
                continue
            sock = ctx.socket(_SOCKET.get(f.role, zmq.SUB))
            sock.setsockopt(zmq.LINGER, 0)
            if f.role not in _SOCKET:
                sock.setsockopt(zmq.SUBSCRIBE, b"")
            mon = sock.get_monitor_socket(MONITOR_EVENTS)
            link = Link(f.endpoint, "", Health("", "starting", "connecting", time.time()),
                        LinkTimes(handshake_s=seconds / 2, no_answer_s=seconds / 2))  # fmt: skip
            try:
                sock.connect(f.endpoint)
            except zmq.ZMQError as exc:
                f.state, f.reason = "connecting", f"cannot connect: {exc}"
                continue
            socks[sock], mons[mon] = (f, link), link
            poller.register(sock, zmq.POLLIN)
            poller.register(mon, zmq.POLLIN)
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            for sock, _ in poller.poll(min(100, max(1, int(left * 1000)))):
                now = time.monotonic()
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if sock in mons or sock in peers:
                        msg = parse_monitor_message(frames)
                        event, value = int(msg["event"]), int(msg["value"])
                        if sock in peers:
                            count_peers(peers[sock][1], event, value)
                        else:
                            mons[sock].on_monitor(event, value, now, 0.0)
                        continue
                    f, link = socks[sock]
                    if f.role == "relay":  # the target's subscriptions: what the relay waits for
                        if frames[0][:1] == b"\x01":
                            f.topics[frames[0][1:].decode(errors="replace")] += 1
                        continue
                    kind = _note(f, frames)
                    if kind != "other":
                        good = kind == "good"
                        link.on_data(
                            int(good), int(not good), next(iter(f.errors), ""), frames, now, 0.0
                        )
            for _, link in socks.values():
                link.tick(time.monotonic(), 0.0)
        for f, fds in peers.values():
            f.publishers = len(fds)
        for f, link in socks.values():
            f.state, f.reason = link.health.state, link.health.reason
            _verdict(f, seconds)
    finally:
        ctx.destroy(linger=0)


def _verdict(f: Found, seconds: float) -> None:
    """Refine the Link's word with what the probe counted."""
    if f.role == "bound":
        _bound_verdict(f, seconds)
    elif f.role == "relay" and f.state in UP_STATES:
        if f.topics:
            subs = ", ".join("every topic" if not t else repr(t) for t in sorted(f.topics))
            f.state, f.reason = "up", f"reachable, subscribed to {subs}"
        else:  # the relay holds frames back until the target subscribes
            f.state, f.reason = "unsubscribed", "connected, but the target subscribed to nothing"
    elif f.role == "relay" and f.state == "connecting" and f.reason == "connecting":
        f.reason = f"no answer in {seconds:g} s (the host is down or the port filtered?)"
    elif f.role == "stream" and not f.batches and f.topics:
        seen = ", ".join(repr(t) for t in sorted(f.topics)[:3])
        f.state, f.reason = "wrong_topic", f"topic mismatch: configured {f.topic!r}, saw {seen}"
    elif f.role == "stream" and f.state == "waiting":
        f.reason = "connected; nothing published during the probe (engine idle?)"
    elif f.role == "stream" and f.errors and not f.batches and f.state in UP_STATES:
        f.state, f.reason = "undecodable", "messages do not decode: not KV events?"


def _bound_verdict(f: Found, seconds: float) -> None:
    """A bound endpoint: who connected and what they sent during the probe."""
    n = f.publishers
    if f.batches:
        f.state, f.reason = "up", f"receiving from {n} publisher(s)"
    elif f.topics:
        seen = ", ".join(repr(t) for t in sorted(f.topics)[:3])
        f.state, f.reason = "wrong_topic", f"topic mismatch: configured {f.topic!r}, saw {seen}"
    elif f.errors:
        f.state, f.reason = "undecodable", "messages do not decode: not KV events?"
    elif n:
        f.state = "connected"
        f.reason = f"{n} publisher(s) connected; nothing published during the probe (engine idle?)"
    else:
        f.state, f.reason = "listening", nobody_connected(f.endpoint, f" in {seconds:g} s")


async def probe_url(f: Found, timeout_s: float) -> None:
    """GET one scheduler metrics URL once."""
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f.endpoint, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp,
        ):
            if resp.status != 200:
                f.state, f.reason = "down", http_status_reason(resp.status, resp.reason)
                return
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError, OSError, UnicodeDecodeError) as exc:
        f.state, f.reason = "down", http_failure_reason(exc, timeout_s)
        return
    families = sum(1 for line in text.splitlines() if line.startswith("# TYPE "))
    f.state, f.reason = "up", f"HTTP 200, {families} metric families"


async def probe_all(found: list[Found], seconds: float) -> None:
    """The ZMQ endpoints (in a thread) and the URLs, concurrently."""
    urls = [f for f in found if f.role == "metrics"]
    zmq_side = [f for f in found if f.role != "metrics"]
    await asyncio.gather(
        asyncio.to_thread(probe_zmq, zmq_side, seconds),
        *(probe_url(f, seconds) for f in urls),
    )
