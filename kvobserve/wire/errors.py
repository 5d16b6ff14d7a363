"""The one exception every wire decoder raises, with a reason from a fixed set."""

from __future__ import annotations

from typing import Literal, get_args

Reason = Literal[
    "frame_count",  # a message with the wrong number of ZMQ frames
    "seq_length",  # the seq frame is not 8 bytes
    "msgpack",  # the payload is not valid msgpack
    "schema",  # valid msgpack, but not the shape of any known version
    "oversize",  # larger than the configured payload limit
    "pickle_refused",  # a pickle payload while pickle is not enabled
    "pickle_forbidden",  # pickle enabled, but the payload names a class we do not accept
]

REASONS: tuple[str, ...] = get_args(Reason)


class WireError(ValueError):
    """A message that cannot be decoded; `reason` is one of REASONS."""

    __slots__ = ("reason",)

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason: Reason = reason
