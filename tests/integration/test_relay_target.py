"""Why a relay target is not reached, from a real XPUB's monitor (the relay's own socket options).

The target names are resolved by libzmq as the relay resolves them. A name with a label longer
than 63 characters is refused by the C library itself, so no DNS query leaves this machine.
"""

from __future__ import annotations

import time

import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvobserve.simulate.ports import free_port
from kvobserve.sources.relay import TARGET_EVENTS, RelayLink

pytestmark = pytest.mark.integration
UNRESOLVABLE = "a" * 64 + ".kvobserve"  # no such name, and not one a resolver is asked about


def _reason_after(target: str, seconds: float = 10.0) -> str:
    """The RelayLink's reason once an XPUB connecting to `target` was retried twice."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        x = ctx.socket(zmq.XPUB)
        x.setsockopt(zmq.LINGER, 0)
        x.setsockopt(zmq.IMMEDIATE, 1)
        x.setsockopt(zmq.RECONNECT_IVL, 100)
        mon = x.get_monitor_socket(TARGET_EVENTS)
        x.connect(target)
        link, retries = RelayLink(target, time.time()), 0
        deadline = time.monotonic() + seconds
        while retries < 2:
            assert time.monotonic() < deadline, link.reason
            if mon.poll(100):
                event = int(parse_monitor_message(mon.recv_multipart())["event"])
                retries += event == zmq.EVENT_CONNECT_RETRIED
                link.on_monitor(event, time.monotonic(), time.time())
        x.disable_monitor()
        return link.reason
    finally:
        ctx.destroy(linger=0)


def test_an_unresolvable_target_is_named_not_refused() -> None:
    target = f"tcp://{UNRESOLVABLE}:5556"
    assert _reason_after(target) == f"cannot resolve {UNRESOLVABLE!r} in {target}: no such host"


def test_a_target_where_nothing_listens_is_refused() -> None:
    target = f"tcp://127.0.0.1:{free_port()}"
    assert _reason_after(target) == f"connection refused: nothing listens at {target}"
