"""Replay request and reply frames of the engines' optional ROUTER replay socket.

The client is a DEALER. It sends `[b"", start_seq]` and receives every buffered batch with
`seq >= start_seq`, then an end marker. Two reply layouts exist (DEALER view):

- without topic (SGLang <= 0.5.21, vLLM <= 0.25): `[b"", seq, payload]`, end `[b"", ff*8, b""]`;
- with topic (SGLang >= 0.5.22, vLLM >= 0.26): `[b"", topic, seq, payload]`,
  end `[b"", b"", ff*8, b""]`.

The payload bytes are the live payload bytes of the same seq.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvobserve.wire.errors import WireError
from kvobserve.wire.kv_events import (
    DEFAULT_MAX_PAYLOAD,
    END_SEQ,
    KvBatch,
    decode_payload,
    decode_seq,
)

_MAX_SEQ = (1 << 64) - 1


def encode_replay_request(start_seq: int) -> list[bytes]:
    """The DEALER request frames `[b"", start_seq (8 bytes big-endian)]`."""
    if not 0 <= start_seq < _MAX_SEQ:
        # ff*8 is the end marker, so it is not a seq a client can ask for
        raise ValueError(f"start_seq {start_seq} out of range 0..2^64-2")
    return [b"", start_seq.to_bytes(8, "big")]


def is_end_marker(frames: Sequence[bytes]) -> bool:
    """True for the end-of-replay marker in either layout."""
    n = len(frames)
    if n == 3:
        return frames[1] == END_SEQ and not frames[2]
    if n == 4:
        return frames[2] == END_SEQ and not frames[3]
    return False


def decode_replay_message(
    frames: Sequence[bytes], topic: str = "", max_payload: int = DEFAULT_MAX_PAYLOAD
) -> KvBatch | None:
    """Decode one replay reply as a DEALER receives it; None for the end marker.

    The 3-frame layout carries no topic, so the batch takes `topic` (the subscription's topic).
    Raises WireError only.
    """
    n = len(frames)
    if n == 3:
        delimiter, seq_frame, payload = frames
    elif n == 4:
        delimiter, topic_frame, seq_frame, payload = frames
        topic = bytes(topic_frame).decode("utf-8", "replace")
    else:
        raise WireError(
            "frame_count",
            f"replay reply of {n} frames, expected 3 ['', seq, payload] or 4 ['', topic, seq, payload]",
        )
    if delimiter:
        raise WireError("frame_count", "replay reply without the empty delimiter frame")
    seq = decode_seq(seq_frame)
    if seq_frame == END_SEQ:
        if payload:
            raise WireError("schema", f"end marker with a {len(payload)}-byte payload")
        return None
    return decode_payload(topic, seq, payload, max_payload)
