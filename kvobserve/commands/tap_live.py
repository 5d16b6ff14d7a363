"""`kvobserve tap ENDPOINT`: the live side, which says why nothing arrives.

The SUB's socket monitor feeds the same Link the collector uses (sources/link.py), so tap gives
the collector's reasons: connection refused, not a ZMQ publisher (an HTTP port), a handshake that
fails. With --topic, a silent stream is subscribed to every topic after a moment, and what comes
under other topics is counted (not printed): a topic mismatch is then named. A run of undecodable
messages ends tap with a summary instead of a screenful of errors; an HTTP answer (the engine's
HTTP port given for its KV-event endpoint) ends it at once, with one line that says so.

With --bind the SUB binds and the publishers connect (bind mode); its monitor then counts the
connections (sources/relay.py), and a silent endpoint says whether anyone connected.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvobserve.sources.health import Health
from kvobserve.sources.link import HTTP_HINT, Link, LinkTimes, looks_like_http
from kvobserve.sources.relay import count_peers, nobody_connected
from kvobserve.wire.kv_events import KvBatch

POLL_MS = 100  # how often the loop checks for Ctrl-C / SIGTERM and the clock
HINT_S = 5.0  # without --timeout: say once why nothing arrives after this long
MAX_BAD_RUN = 10  # undecodable messages in a row (no batch among them): stop
KV_EVENTS_HINT = "is the engine publishing? check its --kv-events-config"
KV_EVENTS_ENDPOINT = "KV events come from the endpoint in the engine's --kv-events-config"


class Handler(Protocol):
    """What the live loop hands each message to (the `_Tap` of commands/tap.py)."""

    stop: bool
    printed: int
    last_error: str  # the reason of the last message that did not decode

    @property
    def done(self) -> bool:
        """--count reached or a stop signal arrived."""
        ...

    def handle(self, frames: list[bytes], source: str, topic: str, where: str) -> KvBatch | None:
        """Decode and print one message; None when it did not decode."""
        ...


@dataclass
class Outcome:
    """How the live loop ended: `message` is the one line for stderr when it failed."""

    ok: bool
    message: str = ""


@dataclass
class _Watch:
    """What the loop has seen so far."""

    start: float
    last_batch: float | None = None
    bad_run: int = 0
    bad_reasons: Counter[str] = field(default_factory=Counter)
    http_like: bool = False
    other_topics: Counter[bytes] = field(default_factory=Counter)
    widened: bool = False  # subscribed to every topic to look for a mismatch
    hinted: str = ""
    peers: set[int] | None = None  # bound: the connections open now (their fds)


def _say(message: str) -> None:
    sys.stderr.write(f"kvobserve tap: {message}\n")
    sys.stderr.flush()


def _why_silent(link: Link, w: _Watch, endpoint: str, topic: str, waited: float) -> str:
    """One line: why no batch came from `endpoint` in `waited` seconds."""
    where = "from" if w.peers is None else "on"
    if w.other_topics:
        seen = ", ".join(repr(t.decode(errors="replace")) for t, _ in w.other_topics.most_common(3))
        first = w.other_topics.most_common(1)[0][0].decode(errors="replace")
        n = sum(w.other_topics.values())
        return (
            f"nothing under topic {topic!r} in {waited:.0f} s {where} {endpoint}, but {n} "
            f"messages under {seen}: use --topic {first!r}, or leave --topic out"
        )
    if w.peers is not None:
        if w.peers:
            state = f"{len(w.peers)} publisher(s) connected, but sent nothing"
        else:
            state = nobody_connected(endpoint)
        return f"nothing received in {waited:.0f} s on {endpoint}: {state}"
    h = link.health
    if h.state in ("waiting", "idle"):
        state = "connected, but the publisher sent nothing"
    elif h.state == "starting":
        state = "no answer yet (the host is down or the port filtered?)"
    else:
        state = h.reason
    return f"nothing received in {waited:.0f} s from {endpoint}: {state} ({KV_EVENTS_HINT})"


def _bad_summary(w: _Watch, endpoint: str) -> str:
    reasons = ", ".join(f"{r} x{n}" for r, n in w.bad_reasons.most_common())
    if w.http_like:
        hint = f"these look like HTTP: is this the engine's HTTP port? {KV_EVENTS_ENDPOINT}"
    else:
        hint = "not KV events? (another publisher on this port, or a wire format kvobserve "
        hint += "does not know: --record them)"
    return f"{w.bad_run} messages in a row from {endpoint} did not decode ({reasons}): {hint}"


def watch_live(
    sub: zmq.Socket[bytes],
    mon: zmq.Socket[bytes],
    tap: Handler,
    endpoint: str,
    topic: str,
    timeout_s: float | None,
    clock: Callable[[], float] = time.monotonic,
    *,
    bound: bool = False,
) -> Outcome:
    """Read `sub` until --count, a stop signal, `timeout_s` without a batch, or a bad run.
    `bound`: `sub` is bound at `endpoint`, subscribed to every topic, and `mon` reports the
    publishers that connect."""
    health = Health("", "starting", "connecting", time.time())
    link = Link(endpoint, topic, health, LinkTimes())
    w = _Watch(start=clock(), widened=bound, peers=set() if bound else None)
    prefix = topic.encode()
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    poller.register(mon, zmq.POLLIN)
    while not tap.done:
        ready = dict(poller.poll(POLL_MS))
        now = clock()
        if mon in ready:
            _drain_monitor(mon, link, w.peers, now)
        if sub in ready:
            end = _drain_sub(sub, tap, w, link, endpoint, topic, prefix, now)
            if end is not None:
                return end
        link.tick(now, time.time())
        quiet = now - (w.last_batch if w.last_batch is not None else w.start)
        widen_after = min(2.0, (timeout_s or HINT_S) / 2)
        if prefix and w.last_batch is None and not w.widened and quiet >= widen_after:
            sub.setsockopt(zmq.SUBSCRIBE, b"")  # look at the other topics too
            w.widened = True
        if timeout_s is not None and quiet >= timeout_s:
            if w.last_batch is None:
                return Outcome(False, _why_silent(link, w, endpoint, topic, quiet))
            return Outcome(True)
        if timeout_s is None and w.last_batch is None and quiet >= HINT_S:
            why = _why_silent(link, w, endpoint, topic, quiet).split(": ", 1)[-1]
            if why != w.hinted:  # once per reason, not every poll
                where = "from" if w.peers is None else "on"
                _say(
                    f"nothing received yet {where} {endpoint}: {why}; still waiting (Ctrl-C stops)"
                )
                w.hinted = why
    return Outcome(True)


def _drain_monitor(mon: zmq.Socket[bytes], link: Link, peers: set[int] | None, now: float) -> None:
    while True:
        try:
            msg = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return
        if peers is not None:
            count_peers(peers, int(msg["event"]), int(msg["value"]))
        else:
            link.on_monitor(int(msg["event"]), int(msg["value"]), now, time.time())


def _drain_sub(
    sub: zmq.Socket[bytes],
    tap: Handler,
    w: _Watch,
    link: Link,
    endpoint: str,
    topic: str,
    prefix: bytes,
    now: float,
) -> Outcome | None:
    for _ in range(1000):
        if tap.done:
            return None
        try:
            frames = sub.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        http = looks_like_http(frames)
        if http and w.last_batch is None:  # an HTTP port: say so once, not per message
            return Outcome(False, f"{endpoint}: {HTTP_HINT}; {KV_EVENTS_ENDPOINT}")
        if prefix and not frames[0].startswith(prefix) and not http:
            w.other_topics[frames[0][:64]] += 1  # only there because of the widened subscription
            continue
        batch = tap.handle(frames, "live", topic, endpoint)
        if batch is not None:
            w.last_batch, w.bad_run = now, 0
            link.on_data(1, 0, "", [], now, time.time())
            continue
        w.bad_run += 1
        w.http_like = w.http_like or http
        w.bad_reasons[tap.last_error] += 1
        if w.bad_run >= MAX_BAD_RUN:
            return Outcome(False, _bad_summary(w, endpoint))
    return None
