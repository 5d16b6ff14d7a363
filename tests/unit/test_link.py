"""The Link state machine of sources/link.py without sockets: monitor events, drains, probes and
time in; the stream's state word, its reason, and what the ingest loop should do out."""

from __future__ import annotations

import logging

import pytest
import zmq

from kvobserve.sources.health import Health
from kvobserve.sources.link import HTTP_HINT, NOT_PUB, Link, LinkTimes

TIMES = LinkTimes()  # the documented defaults: idle 10 s, handshake 5 s, probe after 5 s, ...
HTTP_ANSWER = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"


def _link(topic: str = "kv-events") -> Link:
    return Link("tcp://10.0.0.5:5557", topic, Health("", "starting", "first connect", 0.0), TIMES)


def _state(link: Link) -> tuple[str, str]:
    return link.health.state, link.health.reason


def _connected(link: Link, at: float) -> None:
    """TCP and the ZMQ handshake at `at` (monotonic and wall clocks alike here)."""
    link.on_monitor(zmq.EVENT_CONNECT_DELAYED, 0, at, at)
    link.on_monitor(zmq.EVENT_CONNECTED, 0, at, at)
    link.on_monitor(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0, at, at)


def test_a_refused_connect_differs_from_one_that_gets_no_answer() -> None:
    link = _link()
    link.on_monitor(zmq.EVENT_CONNECT_DELAYED, 0, 0.0, 100.0)
    link.on_monitor(zmq.EVENT_CONNECT_RETRIED, 100, 0.1, 100.1)  # refused at once
    assert _state(link) == ("connecting", "connection refused: nothing listens there")
    assert link.health.since == 100.1
    link.on_monitor(zmq.EVENT_CONNECT_DELAYED, 0, 1.0, 101.0)
    link.on_monitor(zmq.EVENT_CONNECT_RETRIED, 200, 2.5, 102.5)  # pending 1.5 s, then given up
    assert _state(link) == ("connecting", "no answer: the host is down or the port filtered?")
    assert link.health.since == 100.1  # the same state for a new reason keeps its start


def test_a_first_connect_that_hangs_becomes_no_answer_after_no_answer_s() -> None:
    link = _link()
    link.on_monitor(zmq.EVENT_CONNECT_DELAYED, 0, 10.0, 10.0)
    link.tick(10.0 + TIMES.no_answer_s - 0.1, 14.9)
    assert link.health.state == "starting"  # not down yet: the first connect is under way
    link.tick(10.0 + TIMES.no_answer_s, 15.0)
    assert _state(link) == ("connecting", "no answer: the host is down or the port filtered?")


def test_waiting_up_idle_and_back_and_the_publisher_going_away() -> None:
    link = _link()
    _connected(link, 1.0)
    assert _state(link) == ("waiting", "connected, no batch yet")
    link.on_data(3, 0, "", [], 2.0, 2.0)
    assert _state(link) == ("up", "receiving")
    link.tick(2.0 + TIMES.idle_s - 0.5, 11.5)
    assert link.health.state == "up"
    link.tick(2.0 + TIMES.idle_s, 12.0)
    assert _state(link) == ("idle", "no batch for 10 s or more")
    assert link.reason_now(2.0 + 42.4) == "no batch for 42 s"  # the snapshot's reason, as of now
    link.on_data(1, 0, "", [], 50.0, 50.0)
    assert _state(link) == ("up", "receiving") and link.health.since == 50.0
    link.on_monitor(zmq.EVENT_DISCONNECTED, 0, 60.0, 60.0)
    assert _state(link) == ("connecting", "disconnected: the publisher went away (engine stopped?)")
    assert link.zmq_at is None


def test_a_second_publisher_is_the_sequencers_verdict_and_ends_with_it() -> None:
    link = _link()
    _connected(link, 0.0)
    link.observe_duplicate(True, 1.0)
    assert link.health.state == "waiting"  # nothing received: no verdict to show
    link.on_data(1, 0, "", [], 2.0, 2.0)
    link.observe_duplicate(True, 3.0)
    assert _state(link) == ("duplicate", "two publishers on this stream (interleaved or mirrored)")
    link.on_data(1, 0, "", [], 4.0, 4.0)
    assert link.health.state == "duplicate"  # more batches do not hide it
    link.observe_duplicate(False, 5.0)
    assert _state(link) == ("up", "receiving")


def test_undecodable_after_bad_run_messages_in_a_row_and_not_before() -> None:
    link = _link()
    _connected(link, 0.0)
    link.on_data(0, TIMES.bad_run - 1, "msgpack", [b"\x01\x02"], 1.0, 1.0)
    assert link.health.state == "waiting"
    link.on_data(0, 1, "msgpack", [b"\x01\x02"], 2.0, 2.0)
    assert _state(link) == ("undecodable", "messages do not decode (msgpack): not KV events?")
    link.on_data(1, 0, "", [], 3.0, 3.0)
    assert link.health.state == "up" and link.bad_run == 0


def test_an_http_server_is_named_parked_and_reopened_with_a_doubling_wait() -> None:
    link = _link()
    link.on_monitor(zmq.EVENT_CONNECT_DELAYED, 0, 0.0, 0.0)
    link.on_monitor(zmq.EVENT_CONNECTED, 0, 0.0, 0.0)
    link.on_data(0, 1, "msgpack", [b"", HTTP_ANSWER], 1.0, 1.0)  # its answer read as ZMTP 1.0
    assert _state(link) == ("not_publisher", HTTP_HINT)
    assert not link.wants_probe(1.5)  # already known for an HTTP server: nothing to probe
    assert not link.wants_park(1.0 + TIMES.park_after_s - 0.01)
    assert link.wants_park(1.0 + TIMES.park_after_s)
    waits = []
    now = 1.0 + TIMES.park_after_s  # whole seconds: the waits add up exactly
    for _ in range(4):
        link.park(now)
        assert not link.wants_park(now) and not link.wants_reopen(now)
        wait = next(s for s in range(1, 200) if link.wants_reopen(now + s))
        waits.append(wait)
        now += wait
        link.reopened()
        assert link.parked_at is None and link.wants_park(now)  # still not a publisher
    assert waits == [10, 20, 40, 60]  # reopen_s doubling up to reopen_max_s
    _connected(link, now)
    assert link.health.state == "waiting"
    link.park(now + 100)  # a publisher at last resets the wait
    assert next(s for s in range(1, 200) if link.wants_reopen(now + 100 + s)) == TIMES.reopen_s


def test_tcp_without_a_handshake_and_failed_handshakes_are_not_publishers() -> None:
    silent = _link()
    silent.on_monitor(zmq.EVENT_CONNECT_DELAYED, 0, 0.0, 0.0)
    silent.on_monitor(zmq.EVENT_CONNECTED, 0, 0.0, 0.0)
    silent.tick(TIMES.handshake_s - 0.1, 4.9)
    assert silent.health.state == "starting"
    silent.tick(TIMES.handshake_s, 5.0)
    assert _state(silent) == (
        "not_publisher",
        "TCP open but no ZMQ handshake in 5 s: not a ZMQ PUB?",
    )
    protocol = _link()
    protocol.on_monitor(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, 0x11, 0.0, 0.0)
    assert _state(protocol) == (
        "not_publisher",
        "ZMQ handshake failed (protocol error 0x11): not a ZMQ PUB?",
    )
    router = _link()  # a ROUTER drops a SUB after TCP: libzmq does not retry
    router.on_monitor(zmq.EVENT_CONNECTED, 0, 0.0, 0.0)
    router.on_monitor(zmq.EVENT_DISCONNECTED, 0, 0.1, 0.1)
    assert _state(router) == ("not_publisher", NOT_PUB)
    assert router.wants_probe(0.2)  # an HTTP server's answer may hide behind the prefix


def test_a_silent_connected_stream_is_probed_for_its_topics() -> None:
    link = _link("kv-events")
    _connected(link, 0.0)
    assert not link.wants_probe(TIMES.probe_after_s - 0.1)
    assert link.wants_probe(TIMES.probe_after_s)
    link.probe_started(5.0)
    assert not link.wants_probe(6.0)  # one probe at a time
    link.on_probe({b"other-topic": 4}, [b"other-topic", b"..."], 8.0, 8.0)
    assert _state(link) == (
        "wrong_topic",
        "topic mismatch: subscribed 'kv-events', saw 'other-topic'",
    )
    assert not link.wants_probe(5.0 + TIMES.reprobe_s - 1)
    assert link.wants_probe(5.0 + TIMES.reprobe_s)
    link.probe_started(65.0)
    link.on_probe({}, None, 68.0, 68.0)  # the publisher stopped sending anything
    assert _state(link) == ("waiting", "connected, nothing published (engine idle?)")
    link.probe_started(130.0)
    link.on_probe({b"kv-events": 2}, [b"kv-events", b"..."], 133.0, 133.0)
    assert link.health.state == "waiting"  # our topic after all: the engine just started
    link.on_data(1, 0, "", [], 134.0, 134.0)
    assert not link.wants_probe(134.0 + TIMES.reprobe_s)  # batches arrived since connecting


def test_no_probe_without_a_topic_or_for_a_parked_socket() -> None:
    untopiced = _link("")
    _connected(untopiced, 0.0)
    assert not untopiced.wants_probe(100.0)  # an empty prefix already sees every topic
    parked = _link()
    parked.on_monitor(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 0, 0.0, 0.0)
    parked.park(3.0)
    assert not parked.wants_probe(4.0)


def test_listening_before_any_engine_is_news_and_after_one_left_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # seen: `starting -> listening` logged as WARNING at every start of a bound endpoint
    h = Health("bound endpoint w rank 0 (tcp://*:5556)", "starting", "binding", 0.0)
    with caplog.at_level(logging.INFO, logger="kvobserve.health"):
        h.set("listening", "listening on tcp://*:5556, no publisher connected", 1.0)
        h.set("connected", "1 publisher(s) connected to tcp://*:5556", 2.0)
        h.set("listening", "listening on tcp://*:5556, no publisher connected", 3.0)
    assert [(r.levelname, r.getMessage().split(": ", 2)[1]) for r in caplog.records] == [
        ("INFO", "starting -> listening"),
        ("INFO", "listening -> connected"),
        ("WARNING", "connected -> listening"),
    ]


def test_a_host_name_that_does_not_resolve_is_named_so() -> None:
    # libzmq resolves the name before each attempt: no TCP attempt (no CONNECT_DELAYED) when
    # that fails; an address never needs resolving
    named = Link("tcp://engine-0.invalid:5557", "", Health("", "starting", "", 0.0), TIMES)
    named.on_monitor(zmq.EVENT_CONNECT_RETRIED, 100, 1.0, 1.0)
    assert _state(named) == ("connecting", "cannot resolve 'engine-0.invalid': no such host")
    named.on_monitor(zmq.EVENT_CONNECT_DELAYED, 0, 2.0, 2.0)  # it resolves now: refused
    named.on_monitor(zmq.EVENT_CONNECT_RETRIED, 100, 2.1, 2.1)
    assert _state(named) == ("connecting", "connection refused: nothing listens there")
    addr = _link()
    addr.on_monitor(zmq.EVENT_CONNECT_RETRIED, 100, 1.0, 1.0)
    assert _state(addr) == ("connecting", "connection refused: nothing listens there")
