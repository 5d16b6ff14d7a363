"""The one exception every wire decoder raises, with a reason from a fixed set."""

from __future__ import annotations

from typing import Any, Literal, get_args

import msgspec

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


def decode(dec: Any, data: Any, what: str, limit: int | None = None) -> Any:
    """`dec.decode(data)` with every failure a WireError naming `what` (oversize past `limit`)."""
    if limit is not None and len(data) > limit:
        raise WireError("oversize", f"{what} of {len(data)} bytes > limit {limit}")
    try:
        return dec.decode(data)
    except msgspec.ValidationError as exc:
        raise WireError("schema", f"{what}: {exc}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        # msgspec raises UnicodeDecodeError (not DecodeError) for a str with invalid UTF-8
        raise WireError("msgpack", f"{what}: {exc}") from None
    except RecursionError:
        raise WireError("msgpack", f"{what}: nesting too deep") from None
