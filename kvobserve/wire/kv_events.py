"""Decode KV-event messages `[topic, seq, payload]` of every SGLang and vLLM version.

The batch is always the positional msgpack array `[ts, events, dp_rank]`. Events are either
tagged arrays (element 0 is the tag; SGLang <= 0.5.19, vLLM <= 0.23) or tagged maps (key
"type"; SGLang >= 0.5.20, vLLM >= 0.24, fixmap or map16, any key order). Only the fields
kvobserve uses are decoded: `token_ids` stays raw msgpack and only its length is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec
from msgspec import Raw, Struct

from kvobserve.wire.errors import WireError

DEFAULT_MAX_PAYLOAD = 32 * 1024 * 1024


def _lazy(dec: msgspec.msgpack.Decoder[Any], raw: Raw, field: str) -> Any:
    """Decode a field kept raw in the batch; its errors are WireErrors like any other."""
    try:
        return dec.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise WireError("schema", f"{field}: {exc}") from None


END_SEQ = b"\xff" * 8

BlockHash = int | bytes


def _array_len(buf: Raw | bytes) -> int:
    """Length of the msgpack array at the start of `buf` (0 when empty or not an array)."""
    raw = memoryview(buf)
    if not raw:
        return 0
    b = raw[0]
    if 0x90 <= b <= 0x9F:
        return b & 0x0F
    if b == 0xDC:
        return int.from_bytes(raw[1:3], "big")
    if b == 0xDD:
        return int.from_bytes(raw[1:5], "big")
    return 0


class KvEvent(Struct, gc=False):
    """Base of all decoded events; `kind` is the engine's tag."""

    kind: ClassVar[str] = ""


class BlockStored(KvEvent, gc=False):
    """Blocks entered a cache tier. Fields are in wire position order (array form)."""

    kind: ClassVar[str] = "BlockStored"
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: Raw = Raw(b"")
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None

    @property
    def num_tokens(self) -> int:
        """Number of entries in `token_ids` (a token or a bigram pair each), read from the header."""
        return _array_len(self.token_ids)

    def lora(self) -> str | None:
        """The LoRA adapter name, when the version carries one."""
        raise NotImplementedError

    def decoded_token_ids(self) -> list[Any]:
        """The token ids (or bigram pairs); decoded only on request. Raises WireError only."""
        if not self.token_ids:
            return []
        tokens = _lazy(_dec_token_ids, self.token_ids, "token_ids")
        assert isinstance(tokens, list)
        return tokens


class BlockRemoved(KvEvent, gc=False):
    """Blocks left a cache tier."""

    kind: ClassVar[str] = "BlockRemoved"
    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(KvEvent, gc=False):
    """The whole cache was reset."""

    kind: ClassVar[str] = "AllBlocksCleared"


# --- array form: positional; trailing elements beyond the declared ones are ignored ---------


class _StoredArr(BlockStored, array_like=True, tag="BlockStored", gc=False):
    # position 7: vLLM >= 0.15 lora_name (str); SGLang 0.5.18/19 a {"cache_salt": ...} map
    slot7: Raw = Raw(b"")
    extra_keys: Raw = Raw(b"")
    group_idx: int | None = None

    def lora(self) -> str | None:
        first = memoryview(self.slot7)[:1].tobytes()
        if first and (0xA0 <= first[0] <= 0xBF or first[0] in (0xD9, 0xDA, 0xDB)):
            return str(_lazy(_dec_str, self.slot7, "lora_name"))
        return None


class _RemovedArr(BlockRemoved, array_like=True, tag="BlockRemoved", gc=False):
    group_idx: int | None = None


class _ClearedArr(AllBlocksCleared, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


# --- map form: by key name, unknown keys ignored ---------------------------------------------


class _StoredMap(BlockStored, tag_field="type", tag="BlockStored", gc=False):
    lora_name: str | None = None
    group_idx: int | None = None

    def lora(self) -> str | None:
        return self.lora_name


class _RemovedMap(BlockRemoved, tag_field="type", tag="BlockRemoved", gc=False):
    group_idx: int | None = None


class _ClearedMap(AllBlocksCleared, tag_field="type", tag="AllBlocksCleared", gc=False):
    pass


_ArrEvent = _StoredArr | _RemovedArr | _ClearedArr
_MapEvent = _StoredMap | _RemovedMap | _ClearedMap
KNOWN_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


class _BatchArr(Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrEvent]
    dp_rank: int | None = None


class _BatchMap(Struct, array_like=True, gc=False):
    ts: float
    events: list[_MapEvent]
    dp_rank: int | None = None


class _BatchRaw(Struct, array_like=True, gc=False):
    ts: float
    events: list[Raw]
    dp_rank: int | None = None


class _TagArr(Struct, array_like=True):
    tag: str


class _TagMap(Struct):
    type: str


_dec_token_ids = msgspec.msgpack.Decoder(list[int | list[int]])
_dec_str = msgspec.msgpack.Decoder(str)
_dec_batch_arr = msgspec.msgpack.Decoder(_BatchArr)
_dec_batch_map = msgspec.msgpack.Decoder(_BatchMap)
_dec_batch_raw = msgspec.msgpack.Decoder(_BatchRaw)
_dec_event_arr = msgspec.msgpack.Decoder(_ArrEvent)
_dec_event_map = msgspec.msgpack.Decoder(_MapEvent)
_dec_tag_arr = msgspec.msgpack.Decoder(_TagArr)
_dec_tag_map = msgspec.msgpack.Decoder(_TagMap)


class KvBatch(Struct, gc=False):
    """One normalized batch: what one `[topic, seq, payload]` message carried."""

    topic: str
    seq: int
    ts: float
    dp_rank: int | None
    events: list[KvEvent]
    unknown_events: int = 0  # events with a tag we do not know; skipped


def _is_map(first: int) -> bool:
    return 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)


def _is_array(first: int) -> bool:
    return 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)


def _first_event_byte(payload: bytes) -> int:
    """The first byte of the first event for the usual `[f64 ts, [events...], rank]` layout, or -1."""
    if len(payload) < 12 or payload[0] != 0x93 or payload[1] != 0xCB:
        return -1
    h = payload[10]
    if 0x91 <= h <= 0x9F:
        return payload[11]
    if h == 0xDC and len(payload) > 13:
        return payload[13]
    if h == 0xDD and len(payload) > 15:
        return payload[15]
    return -1


def _decode_one_event(raw: Raw) -> KvEvent | None:
    """Decode one event by its shape; None for an unknown tag."""
    head = memoryview(raw)[:1].tobytes()
    if not head:
        raise WireError("schema", "empty event")
    first = head[0]
    try:
        if _is_array(first):
            return _dec_event_arr.decode(raw)
        if _is_map(first):
            return _dec_event_map.decode(raw)
    except msgspec.ValidationError as exc:
        try:
            tag = (
                _dec_tag_arr.decode(raw).tag if _is_array(first) else _dec_tag_map.decode(raw).type
            )
        except msgspec.DecodeError:
            raise WireError("schema", f"event: {exc}") from None
        if tag not in KNOWN_TAGS:
            return None
        raise WireError("schema", f"{tag}: {exc}") from None
    raise WireError("schema", f"event is neither an array nor a map (0x{first:02x})")


def decode_payload(
    topic: str, seq: int, payload: bytes, max_payload: int = DEFAULT_MAX_PAYLOAD
) -> KvBatch:
    """Decode one msgpack batch payload; raises WireError only."""
    if len(payload) > max_payload:
        raise WireError("oversize", f"payload of {len(payload)} bytes > limit {max_payload}")
    first = _first_event_byte(payload)
    dec = _dec_batch_map if _is_map(first) else _dec_batch_arr
    try:
        b = dec.decode(payload)
        return KvBatch(topic, seq, b.ts, b.dp_rank, b.events)  # type: ignore[arg-type]
    except msgspec.ValidationError:
        pass  # mixed shapes, unknown tag or bad schema: decide event by event below
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        # msgspec raises UnicodeDecodeError (not DecodeError) for a str with invalid UTF-8
        raise WireError("msgpack", str(exc)) from None
    except RecursionError:
        raise WireError("msgpack", "nesting too deep") from None
    try:
        rb = _dec_batch_raw.decode(payload)
    except msgspec.ValidationError as exc:
        raise WireError("schema", f"batch: {exc}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise WireError("msgpack", str(exc)) from None
    except RecursionError:
        raise WireError("msgpack", "nesting too deep") from None
    events: list[KvEvent] = []
    unknown = 0
    for raw in rb.events:
        try:
            ev = _decode_one_event(raw)
        except RecursionError:
            raise WireError("msgpack", "nesting too deep") from None
        except UnicodeDecodeError as exc:  # Raw events were not UTF-8-checked yet
            raise WireError("msgpack", str(exc)) from None
        if ev is None:
            unknown += 1
        else:
            events.append(ev)
    return KvBatch(topic, seq, rb.ts, rb.dp_rank, events, unknown)


def decode_seq(frame: bytes) -> int:
    """The 8-byte big-endian unsigned seq frame."""
    if len(frame) != 8:
        raise WireError("seq_length", f"seq frame of {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big")


def decode_message(frames: Sequence[bytes], max_payload: int = DEFAULT_MAX_PAYLOAD) -> KvBatch:
    """Decode a live PUB message `[topic, seq, payload]`."""
    if len(frames) != 3:
        raise WireError("frame_count", f"{len(frames)} frames, expected 3 [topic, seq, payload]")
    topic, seq, payload = frames
    if len(seq) != 8:
        raise WireError("seq_length", f"seq frame of {len(seq)} bytes, expected 8")
    return decode_payload(
        topic.decode("utf-8", "replace"), int.from_bytes(seq, "big"), payload, max_payload
    )


def hash_json(h: BlockHash | None) -> int | str | None:
    """A block hash as in expected.json: the integer, or lowercase hex for bytes hashes."""
    if isinstance(h, bytes):
        return h.hex()
    return h


def event_to_dict(ev: KvEvent, token_ids: bool = False) -> dict[str, Any]:
    """The normalized JSON form of one event (the `tap` format)."""
    if isinstance(ev, BlockStored):
        d: dict[str, Any] = {
            "type": ev.kind,
            "block_hashes": [hash_json(h) for h in ev.block_hashes],
            "parent_block_hash": hash_json(ev.parent_block_hash),
            "block_size": ev.block_size,
            "num_tokens": ev.num_tokens,
            "medium": ev.medium,
        }
        lora_name = ev.lora()
        if lora_name is not None:
            d["lora_name"] = lora_name
        if token_ids:
            d["token_ids"] = ev.decoded_token_ids()
        return d
    if isinstance(ev, BlockRemoved):
        return {
            "type": ev.kind,
            "block_hashes": [hash_json(h) for h in ev.block_hashes],
            "medium": ev.medium,
        }
    return {"type": ev.kind}


def batch_to_dict(batch: KvBatch, token_ids: bool = False) -> dict[str, Any]:
    """The normalized JSON form of one batch (the `tap` format)."""
    return {
        "topic": batch.topic,
        "seq": batch.seq,
        "dp_rank": batch.dp_rank,
        "ts": batch.ts,
        "events": [event_to_dict(e, token_ids) for e in batch.events],
    }
