"""Decode KV-event messages `[topic, seq, payload]` of every SGLang and vLLM version.

The batch is always the positional msgpack array `[ts, events, dp_rank]`. Events are either
tagged arrays (element 0 is the tag; SGLang <= 0.5.19, vLLM <= 0.23) or tagged maps (key
"type"; SGLang >= 0.5.20, vLLM >= 0.24, fixmap or map16, any key order). Only the fields
kvobserve uses are decoded: `token_ids` stays raw msgpack and only its length is read. Unknown map
keys and trailing array elements are skipped; events with an unknown tag are counted and skipped.

vLLM events of a KV-cache group other than the main one (`group_idx` > 0, or a store whose
`kv_cache_spec_kind` is not a main-attention kind: sliding window, mamba, ... of hybrid models)
are counted in `KvBatch.other_group_events` and left out of `events` (docs/stream-semantics.md).
The common case costs nothing: the first decoder accepts only main-group values, so only a batch
that carries another group takes the second, permissive decoder.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Literal

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

# vLLM KVCacheSpecKind values of the main attention; every other kind (sliding_window, mamba,
# chunked_local_attention, cross/encoder-only attention, unknown, ...) is a side group
MAIN_KV_CACHE_SPEC_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
_MainKind = Literal["full_attention", "mla_attention", "sink_full_attention"]
_MainGroup = Literal[0]


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
        return None

    @property
    def lora_name(self) -> str | None:
        """As `lora()`; the map forms shadow it with their field (a plain attribute read)."""
        return self.lora()

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
# Each event has two classes: the main-group one (group_idx 0 or absent, a main-attention kind)
# that the first decoder uses, and one for any group that the second decoder uses.


class _StoredArrBase(BlockStored, array_like=True, gc=False):
    # position 7: vLLM >= 0.15 lora_name (str); SGLang 0.5.18/19 a {"cache_salt": ...} map
    slot7: Raw = Raw(b"")
    extra_keys: Raw = Raw(b"")

    def lora(self) -> str | None:
        slot = self.slot7
        if len(slot) < 2:  # absent, nil or "": no allocation on the usual path
            return None
        first = memoryview(slot)[:1].tobytes()
        if 0xA0 <= first[0] <= 0xBF or first[0] in (0xD9, 0xDA, 0xDB):
            return str(_lazy(_dec_str, slot, "lora_name"))
        return None


class _StoredArr(_StoredArrBase, tag="BlockStored", gc=False):
    group_idx: _MainGroup | None = None  # vLLM 0.21-0.23
    kv_cache_spec_kind: _MainKind | None = None  # vLLM 0.22-0.23


class _StoredArrAny(_StoredArrBase, tag="BlockStored", gc=False):
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _RemovedArr(BlockRemoved, array_like=True, tag="BlockRemoved", gc=False):
    group_idx: _MainGroup | None = None


class _RemovedArrAny(BlockRemoved, array_like=True, tag="BlockRemoved", gc=False):
    group_idx: int | None = None


class _ClearedArr(AllBlocksCleared, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


# --- map form: by key name, unknown keys ignored ---------------------------------------------


class _StoredMapBase(BlockStored, tag_field="type", gc=False):
    lora_name: str | None = None

    def lora(self) -> str | None:
        return self.lora_name


class _StoredMap(_StoredMapBase, tag="BlockStored", gc=False):
    group_idx: _MainGroup | None = None
    kv_cache_spec_kind: _MainKind | None = None


class _StoredMapAny(_StoredMapBase, tag="BlockStored", gc=False):
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _RemovedMap(BlockRemoved, tag_field="type", tag="BlockRemoved", gc=False):
    group_idx: _MainGroup | None = None


class _RemovedMapAny(BlockRemoved, tag_field="type", tag="BlockRemoved", gc=False):
    group_idx: int | None = None


class _ClearedMap(AllBlocksCleared, tag_field="type", tag="AllBlocksCleared", gc=False):
    pass


_ArrEvent = _StoredArr | _RemovedArr | _ClearedArr
_MapEvent = _StoredMap | _RemovedMap | _ClearedMap
_ArrEventAny = _StoredArrAny | _RemovedArrAny | _ClearedArr
_MapEventAny = _StoredMapAny | _RemovedMapAny | _ClearedMap
KNOWN_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


def _batch(name: str, event: Any) -> Any:
    """The batch layout `[ts, events, dp_rank]` with events decoded as `event`."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = [
        ("ts", float),
        ("events", list[event]),
        ("dp_rank", int | None, None),
    ]
    return msgspec.defstruct(name, fields, array_like=True, gc=False)


_BatchArr = _batch("_BatchArr", _ArrEvent)
_BatchMap = _batch("_BatchMap", _MapEvent)
_BatchArrAny = _batch("_BatchArrAny", _ArrEventAny)
_BatchMapAny = _batch("_BatchMapAny", _MapEventAny)
_BatchRaw = _batch("_BatchRaw", Raw)


class _TagArr(Struct, array_like=True):
    tag: str


class _TagMap(Struct):
    type: str


_dec_token_ids = msgspec.msgpack.Decoder(list[int | list[int]])
_dec_str = msgspec.msgpack.Decoder(str)
_dec_batch_arr = msgspec.msgpack.Decoder(_BatchArr)
_dec_batch_map = msgspec.msgpack.Decoder(_BatchMap)
_dec_batch_arr_any = msgspec.msgpack.Decoder(_BatchArrAny)
_dec_batch_map_any = msgspec.msgpack.Decoder(_BatchMapAny)
_dec_batch_raw = msgspec.msgpack.Decoder(_BatchRaw)
_dec_event_arr = msgspec.msgpack.Decoder(_ArrEvent)
_dec_event_map = msgspec.msgpack.Decoder(_MapEvent)
_dec_event_arr_any = msgspec.msgpack.Decoder(_ArrEventAny)
_dec_event_map_any = msgspec.msgpack.Decoder(_MapEventAny)
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
    other_group_events: int = 0  # vLLM events of a side KV-cache group; set aside


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


def in_main_group(ev: KvEvent) -> bool:
    """False for a vLLM event of a side KV-cache group (group_idx > 0, or a non-main kind)."""
    if getattr(ev, "group_idx", None):
        return False
    kind = getattr(ev, "kv_cache_spec_kind", None)
    return kind is None or kind in MAIN_KV_CACHE_SPEC_KINDS


_OTHER_GROUP = "other_group"  # _decode_one_event: an event set aside


def _decode_one_event(raw: Raw) -> KvEvent | str | None:
    """Decode one event by its shape; None for an unknown tag, _OTHER_GROUP for a side group."""
    head = memoryview(raw)[:1].tobytes()
    if not head:
        raise WireError("schema", "empty event")
    first = head[0]
    is_array = _is_array(first)
    if not is_array and not _is_map(first):
        raise WireError("schema", f"event is neither an array nor a map (0x{first:02x})")
    try:
        return _dec_event_arr.decode(raw) if is_array else _dec_event_map.decode(raw)
    except msgspec.ValidationError as exc:
        error = exc
    try:
        ev: KvEvent = _dec_event_arr_any.decode(raw) if is_array else _dec_event_map_any.decode(raw)
        return ev if in_main_group(ev) else _OTHER_GROUP
    except msgspec.ValidationError:
        pass
    try:
        tag = _dec_tag_arr.decode(raw).tag if is_array else _dec_tag_map.decode(raw).type
    except msgspec.DecodeError:
        raise WireError("schema", f"event: {error}") from None
    if tag not in KNOWN_TAGS:
        return None
    raise WireError("schema", f"{tag}: {error}") from None


def _try_decode(dec: msgspec.msgpack.Decoder[Any], payload: bytes) -> Any:
    """The decoded batch, or None when it does not fit `dec`'s schema; WireError if not msgpack."""
    try:
        return dec.decode(payload)
    except msgspec.ValidationError:
        return None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        # msgspec raises UnicodeDecodeError (not DecodeError) for a str with invalid UTF-8
        raise WireError("msgpack", str(exc)) from None
    except RecursionError:
        raise WireError("msgpack", "nesting too deep") from None


def decode_payload(
    topic: str, seq: int, payload: bytes, max_payload: int = DEFAULT_MAX_PAYLOAD
) -> KvBatch:
    """Decode one msgpack batch payload; raises WireError only."""
    if len(payload) > max_payload:
        raise WireError("oversize", f"payload of {len(payload)} bytes > limit {max_payload}")
    is_map = _is_map(_first_event_byte(payload))
    b = _try_decode(_dec_batch_map if is_map else _dec_batch_arr, payload)
    if b is not None:
        return KvBatch(topic, seq, b.ts, b.dp_rank, b.events)
    # a side KV-cache group, mixed shapes, an unknown tag or a bad schema
    b = _try_decode(_dec_batch_map_any if is_map else _dec_batch_arr_any, payload)
    if b is not None:
        events = [ev for ev in b.events if in_main_group(ev)]
        return KvBatch(topic, seq, b.ts, b.dp_rank, events, 0, len(b.events) - len(events))
    try:
        rb = _dec_batch_raw.decode(payload)
    except msgspec.ValidationError as exc:
        raise WireError("schema", f"batch: {exc}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise WireError("msgpack", str(exc)) from None
    except RecursionError:
        raise WireError("msgpack", "nesting too deep") from None
    kept: list[KvEvent] = []
    unknown = other = 0
    for raw in rb.events:
        try:
            ev = _decode_one_event(raw)
        except RecursionError:
            raise WireError("msgpack", "nesting too deep") from None
        except (UnicodeDecodeError, msgspec.DecodeError) as exc:  # Raw events: not checked yet
            raise WireError("msgpack", str(exc)) from None
        if ev is None:
            unknown += 1
        elif isinstance(ev, str):
            other += 1
        else:
            kept.append(ev)
    return KvBatch(topic, seq, rb.ts, rb.dp_rank, kept, unknown, other)


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
