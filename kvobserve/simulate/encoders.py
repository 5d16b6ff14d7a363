"""Byte-exact KV-event encoding: every engine version's `WireFormat` (declared in the engines'
simulator profiles, simulate/engines/) by name, the batch payload and the live and replay
frames."""

from __future__ import annotations

from typing import Any

import msgspec

from kvobserve.simulate.engines import ENGINES
from kvobserve.simulate.wire_format import RemoveMeta, StoreMeta, WireFormat
from kvobserve.simulate.wire_structs import Batch, Hash

END_SEQ = b"\xff" * 8

_encoder = msgspec.msgpack.Encoder()


def encode_batch(ts: float, events: list[Any], dp_rank: int | None) -> bytes:
    """One msgpack batch payload `[ts, events, dp_rank]`."""
    return _encoder.encode(Batch(ts, events, dp_rank))


FORMATS: dict[str, WireFormat] = {f.name: f for e in ENGINES.values() for f in e.formats}


def get_format(name: str) -> WireFormat:
    """The format by name; ValueError naming the value and the choices otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(
            f"format: unknown wire format {name!r}; choose one of {sorted(FORMATS)}"
        ) from None


def live_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The PUB message `[topic, seq(8 B BE), payload]`."""
    return [topic, seq.to_bytes(8, "big"), payload]


def replay_frames(fmt: WireFormat, topic: bytes, seq_bytes: bytes, payload: bytes) -> list[bytes]:
    """One replayed batch as the DEALER sees it (3 frames, or 4 with topic)."""
    if fmt.replay_with_topic:
        return [b"", topic, seq_bytes, payload]
    return [b"", seq_bytes, payload]


def replay_end(fmt: WireFormat) -> list[bytes]:
    """The end-of-replay marker as the DEALER sees it."""
    if fmt.replay_with_topic:
        return [b"", b"", END_SEQ, b""]
    return [b"", END_SEQ, b""]


_STORE_META_KEYS = tuple(StoreMeta.__dataclass_fields__)
_REMOVE_META_KEYS = tuple(RemoveMeta.__dataclass_fields__)


def _hash_from_json(v: Any) -> Hash | None:
    if isinstance(v, str):
        return bytes.fromhex(v)
    return v


def event_from_dict(fmt: WireFormat, ev: dict[str, Any]) -> Any:
    """The version struct for one event in expected.json form (used by the capture tests)."""
    kind = ev["type"]
    if kind == "BlockStored":
        meta = StoreMeta(**{k: ev.get(k) for k in _STORE_META_KEYS})
        return fmt.stored(
            [_hash_from_json(h) for h in ev["block_hashes"]],  # type: ignore[misc]
            _hash_from_json(ev.get("parent_block_hash")),
            ev.get("token_ids", []),
            ev["block_size"],
            ev.get("medium"),
            meta,
        )
    if kind == "BlockRemoved":
        return fmt.removed(
            [_hash_from_json(h) for h in ev["block_hashes"]],  # type: ignore[misc]
            ev.get("medium"),
            RemoveMeta(**{k: ev.get(k) for k in _REMOVE_META_KEYS}),
        )
    if kind == "AllBlocksCleared":
        return fmt.cleared
    raise ValueError(f"event type: unknown {kind!r}")
