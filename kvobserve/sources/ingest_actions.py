"""What the stream core asks of the sockets and the disk (sources/stream_table.py ->
sources/kv_stream.py).

The core owns every stream's state and opens no socket: each input it takes may append actions to
its outbox, and the shell that owns the sockets carries them out, in order, then reports back what
happened (a bind that failed, a connect refused, a message, a monitor event). Streams and bound
endpoints travel by reference: the shell keys its sockets by the object the action names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the types only: the core's objects (no import cycle at run time either)
    from kvobserve.sources.bind import Listener
    from kvobserve.sources.stream_state import WatchedStream


@dataclass(frozen=True, slots=True)
class Connect:
    """Open the stream's SUB (its spec's endpoint and topic) with its socket monitor."""

    stream: WatchedStream


@dataclass(frozen=True, slots=True)
class Disconnect:
    """Close the stream's SUB and monitor (its replay and probe are ended by their own actions)."""

    stream: WatchedStream


@dataclass(frozen=True, slots=True)
class Probe:
    """Open a short-lived SUB with an empty prefix on the stream's endpoint (sources/probes.py)."""

    stream: WatchedStream


@dataclass(frozen=True, slots=True)
class EndProbe:
    """Close the stream's probe SUB."""

    stream: WatchedStream


@dataclass(frozen=True, slots=True)
class Replay:
    """Open a DEALER to `endpoint` and ask for every batch from `start_seq` on; its messages go
    to the core under `replay_id`."""

    stream: WatchedStream
    replay_id: int
    endpoint: str
    start_seq: int


@dataclass(frozen=True, slots=True)
class EndReplay:
    """Close the stream's replay DEALER."""

    stream: WatchedStream


@dataclass(frozen=True, slots=True)
class Restore:
    """Read the stream's checkpoint (its identity and `config` fingerprint) and report it with
    `StreamTable.restored`, before any message of the stream is taken."""

    stream: WatchedStream


@dataclass(frozen=True, slots=True)
class Bind:
    """Bind the endpoint's SUB (its spec's endpoint; with `relay_to`, have the relay process
    bind it and forward first); report with `StreamTable.bound`."""

    listener: Listener


@dataclass(frozen=True, slots=True)
class Unbind:
    """Release the endpoint (its SUB or its relay lane)."""

    listener: Listener


SocketAction = (
    Connect | Disconnect | Probe | EndProbe | Replay | EndReplay | Restore | Bind | Unbind
)
