"""Where the simulator takes ports it is not given: port 0 for one, a block for ranges.

An engine's ranks publish on base + rank, so a range cannot be had by binding port 0. Ranges
(and single ports that a caller binds only later) come from a block below the kernel's ephemeral
range, where no outgoing connection takes a port; `KVOBSERVE_SIM_PORTS=lo-hi` narrows it, so
that processes sharing a machine (the test suite's workers) each draw from their own block.
A port handed out here is not handed out again by this process for a while: it was free when
it was picked, and whoever asked binds it only later.
"""

from __future__ import annotations

import os
import random
import socket
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path

ENV = "KVOBSERVE_SIM_PORTS"
LOWEST = 20000  # the block's default start; below it sit many services' well-known ports
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_RECENT = 4096

_rng = random.Random()  # port picking only; never part of the simulated content
_recent: deque[int] = deque()
_recent_set: set[int] = set()
_recent_lock = threading.Lock()


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (32768 where /proc does not say)."""
    try:
        return int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_block() -> tuple[int, int]:
    """(first, last) port this process picks ranges from: `KVOBSERVE_SIM_PORTS`, else
    LOWEST up to the ephemeral range."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return LOWEST, ephemeral_start() - 1
    lo, sep, hi = text.partition("-")
    if not (sep and lo.isdigit() and hi.isdigit() and 0 < int(lo) <= int(hi) <= 65535):
        raise ValueError(f"{ENV}: {text!r} is not a port range FIRST-LAST (e.g. 20000-26000)")
    return int(lo), int(hi)


def worker_block(index: int, count: int) -> tuple[int, int]:
    """The `index`-th of `count` disjoint equal blocks of the default block (one per worker of
    a parallel test run)."""
    if not 0 <= index < count:
        raise ValueError(f"worker_block: index {index} is not below count {count}")
    lo, hi = LOWEST, ephemeral_start() - 1
    size = (hi - lo + 1) // count
    return lo + index * size, lo + (index + 1) * size - 1


def _hand_out(base: int, count: int) -> bool:
    """Claim `count` ports from `base` unless one was handed out lately; whether claimed."""
    ports = range(base, base + count)
    with _recent_lock:
        if not _recent_set.isdisjoint(ports):
            return False
        _remember(ports)
    return True


def _remember(ports: Iterable[int]) -> None:
    _recent.extend(ports)
    _recent_set.update(ports)
    while len(_recent) > _RECENT:
        _recent_set.discard(_recent.popleft())


def remember(ports: Iterable[int]) -> None:
    """Ports bound by this process (not handed out here): not handed out while lately seen."""
    with _recent_lock:
        _remember(ports)


def candidate_base(count: int, avoid: Sequence[int] = ()) -> int | None:
    """A random base in the block whose `count` ports this process did not hand out lately and
    that overlaps no range of `avoid` (bases of ranges `count` long); None on a bad draw."""
    lo, hi = port_block()
    if hi - lo + 1 < count:
        raise ValueError(f"{ENV}: {lo}-{hi} holds fewer than {count} ports")
    base = _rng.randint(lo, hi - count + 1)
    if any(abs(base - other) < count for other in avoid):
        return None
    with _recent_lock:
        if not _recent_set.isdisjoint(range(base, base + count)):
            return None
    return base


def free_port_range(
    host: str | Sequence[str], count: int, attempts: int = 100, avoid: Sequence[int] = ()
) -> int:
    """A base port whose next `count` TCP ports in the block were all free on every host a
    moment ago; handed out to the caller, who binds them.

    Ranges starting at a base in `avoid` (each `count` long) are not overlapped, nor are the
    last few thousand ports this process handed out.
    """
    hosts = [host] if isinstance(host, str) else list(host)
    for _ in range(attempts):
        base = candidate_base(count, avoid)
        if base is None:
            continue
        socks: list[socket.socket] = []
        try:
            for h in hosts:
                for off in range(count):
                    s = socket.socket()
                    socks.append(s)
                    s.bind((h, base + off))
        except OSError:
            continue
        else:
            if _hand_out(base, count):
                return base
        finally:
            for s in socks:
                s.close()
    lo, hi = port_block()
    raise OSError(f"no {count} consecutive free ports in {lo}-{hi} on {', '.join(hosts)}")


def free_port(host: str = "127.0.0.1") -> int:
    """One TCP port of the block on `host` that was free a moment ago, for a process that
    cannot bind port 0 and report it."""
    return free_port_range(host, 1)
