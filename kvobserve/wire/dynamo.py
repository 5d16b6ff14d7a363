"""Decode NVIDIA Dynamo's KV event plane (NATS core and ZMQ direct) into kvobserve's model.

- Envelope: a msgpack map `{topic, publisher_id, sequence, published_at[, published_at_ns],
  payload: bin}` decoded by name. NATS: the message body. ZMQ direct: 4 frames `[topic,
  publisher_id u64 BE, sequence u64 BE, 0x01 + u32 BE length + envelope]`.
- `kv-events` payload: an array of RouterEvent maps (1.6.x) or a single map (1.2.x); <= 1.2
  JetStream/2025 subjects carry one JSON RouterEvent and no envelope.
- `kv_metrics`: ActiveLoad; `forward-pass-metrics`: the same ForwardPassMetrics map as SGLang's.
Unknown keys (envelope and RouterEvent level) and unknown `data` variants are counted and skipped.
Everything raises WireError only. Layouts and the mapping are in docs/wire.md ("Dynamo").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Literal

import msgspec
from msgspec import UNSET, Raw, Struct, UnsetType

from kvobserve.wire.dynamo_subject import Subject, parse_subject
from kvobserve.wire.errors import WireError, decode
from kvobserve.wire.kv_events import (
    DEFAULT_MAX_PAYLOAD,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvBatch,
    KvEvent,
)
from kvobserve.wire.scheduler import ForwardPassMetrics, decode_forward_pass_metrics

FRAME_VERSION = 1
FRAME_HEADER_SIZE = 5  # version u8 + payload length u32 BE
# Dynamo StorageTier -> kvobserve medium (the names SGLang/vLLM put in `medium`)
TIER_MEDIUM: dict[str, str] = {
    "device": "GPU",
    "host_pinned": "CPU",
    "disk": "DISK",
    "external": "EXTERNAL",
}
StreamKey = tuple[int, int]  # (worker_id, dp_rank)


# --- wire structs (decoded by name; unknown keys ignored by msgspec) ------------------------


class Envelope(Struct, gc=False):
    """Dynamo's EventEnvelope."""

    topic: str
    publisher_id: int  # random per EventPublisher (1.6.x); the worker id in 1.2.x
    sequence: int  # per publisher, from 0, +1 per message
    published_at: int  # unix ms
    payload: bytes
    published_at_ns: int | None = None  # main after 1.6.1


class Block(Struct, gc=False):
    """One stored block; `tokens_hash` and `mm_extra_info` are not decoded."""

    block_hash: int


class StoredData(Struct, gc=False):
    """`{"stored": ...}`."""

    blocks: list[Block]
    parent_hash: int | None = None
    start_position: int | None = None


class RemovedData(Struct, gc=False):
    """`{"removed": ...}`."""

    block_hashes: list[int]


class VariantData(Struct, gc=False):
    """A newtype variant of KvCacheEventData: a 1-entry map; no known key = unknown variant."""

    stored: StoredData | None = None
    removed: RemovedData | None = None
    tier_cleared: str | None = None  # main after 1.6.1: TierCleared(StorageTier)


class CacheEvent(Struct, gc=False):
    """KvCacheEvent; `data` is "cleared" (unit variant) or a VariantData."""

    event_id: int
    data: VariantData | str
    dp_rank: int = 0


class RouterEvent(Struct, gc=False):
    """One RouterEvent; optional fields are UNSET when absent (to count unknown keys)."""

    worker_id: int
    event: CacheEvent
    storage_tier: str | UnsetType = UNSET  # serde default: "device"
    residency_domain: str | UnsetType = UNSET  # "worker" | "cache_owner" (1.6.x)
    state_source: Raw | UnsetType = UNSET
    session_id: str | UnsetType | None = UNSET

    @property
    def tier(self) -> str:
        """The storage tier, with Dynamo's default."""
        return "device" if self.storage_tier is UNSET else self.storage_tier


class ActiveLoad(Struct, frozen=True, gc=False):
    """Worker load on `kv_metrics` (per dp_rank; 1 ms debounce plus a 10 s heartbeat)."""

    worker_id: int
    dp_rank: int = 0
    active_decode_blocks: int | None = None
    active_prefill_tokens: int | None = None
    kv_used_blocks: int | None = None
    waiting_requests: int | None = None  # main after 1.6.1


# --- decoded message -----------------------------------------------------------------------


class DynamoMessage(Struct, gc=False):
    """One event-plane message, before its payload is decoded."""

    topic: str
    payload: bytes
    encoding: Literal["msgpack", "json"]
    publisher_id: int | None = None  # envelope; None for JSON bodies
    sequence: int | None = None
    published_at_ms: int | None = None
    published_at_ns: int | None = None
    subject: Subject | None = None  # NATS only
    header_mismatch: tuple[str, ...] = ()  # ZMQ: header fields ("topic", ...) != the envelope
    unknown_keys: int = 0  # envelope keys kvobserve does not know


class RouterEvents(Struct, gc=False):
    """The RouterEvents of one `kv-events` payload, with the bytes of each (for duplicates)."""

    events: list[RouterEvent]
    raws: list[bytes]
    single: bool  # a lone map (1.2.x / JSON), not an array
    unknown_keys: int = 0  # RouterEvent-level keys kvobserve does not know
    unknown_variants: int = 0  # events skipped: `data` variant unknown


class DynamoStored(BlockStored, gc=False):
    """BlockStored from Dynamo: no token ids, no LoRA name on this wire."""

    def lora(self) -> str | None:
        return None


class TierCleared(KvEvent, gc=False):
    """Every block of one medium was dropped (Dynamo main's TierCleared(tier))."""

    kind: ClassVar[str] = "TierCleared"
    medium: str


# --- decoders ------------------------------------------------------------------------------

_dec_env = msgspec.msgpack.Decoder(Envelope)
_dec_raws = msgspec.msgpack.Decoder(list[Raw])
_dec_event = msgspec.msgpack.Decoder(RouterEvent)
_dec_event_json = msgspec.json.Decoder(RouterEvent)
_dec_load = msgspec.msgpack.Decoder(ActiveLoad)
_ENVELOPE_KEYS = 5
_NO_TOKENS = Raw(b"")


def _map_len(buf: bytes | Raw) -> int:
    """Entry count of the msgpack map at the start of `buf` (-1 when it is not a map)."""
    raw = memoryview(buf)
    b = raw[0] if raw else 0
    if 0x80 <= b <= 0x8F:
        return b & 0x0F
    if b == 0xDE and len(raw) >= 3:
        return int.from_bytes(raw[1:3], "big")
    if b == 0xDF and len(raw) >= 5:
        return int.from_bytes(raw[1:5], "big")
    return -1


def _check_size(data: bytes, limit: int, what: str) -> None:
    if len(data) > limit:
        raise WireError("oversize", f"{what} of {len(data)} bytes > limit {limit}")


def decode_envelope(body: bytes, max_payload: int = DEFAULT_MAX_PAYLOAD) -> DynamoMessage:
    """Decode an EventEnvelope (a NATS body, or the envelope inside a ZMQ frame)."""
    _check_size(body, max_payload, "envelope")
    env: Envelope = decode(_dec_env, body, "envelope")
    known = _ENVELOPE_KEYS + (env.published_at_ns is not None)
    return DynamoMessage(
        env.topic,
        env.payload,
        "msgpack",
        env.publisher_id,
        env.sequence,
        env.published_at,
        env.published_at_ns,
        unknown_keys=max(0, _map_len(body) - known),
    )


def decode_nats_message(
    subject: str, body: bytes, max_payload: int = DEFAULT_MAX_PAYLOAD
) -> DynamoMessage:
    """A NATS message: envelope body, or a bare JSON RouterEvent on the older subjects."""
    subj = parse_subject(subject)
    if body[:1] == b"{":
        _check_size(body, max_payload, "JSON body")
        topic = "kv-events" if subj.topic in ("kv_events", "queue") else subj.topic
        return DynamoMessage(topic, body, "json", subject=subj)
    msg = decode_envelope(body, max_payload)
    msg.subject = subj
    return msg


def decode_zmq_message(
    frames: Sequence[bytes], max_payload: int = DEFAULT_MAX_PAYLOAD
) -> DynamoMessage:
    """ZMQ direct: `[topic, publisher_id, sequence, frame]`; disagreements go to header_mismatch."""
    if len(frames) != 4:
        raise WireError("frame_count", f"{len(frames)} frames, expected 4 [topic, id, seq, frame]")
    topic, pid, seq, frame = frames
    if len(pid) != 8 or len(seq) != 8:
        raise WireError("seq_length", f"id/sequence frames of {len(pid)}/{len(seq)} bytes, not 8")
    if len(frame) < FRAME_HEADER_SIZE:
        raise WireError("msgpack", f"frame of {len(frame)} bytes, shorter than its header")
    if frame[0] != FRAME_VERSION:
        raise WireError("schema", f"frame version {frame[0]}, expected {FRAME_VERSION}")
    length = int.from_bytes(frame[1:5], "big")
    if length != len(frame) - FRAME_HEADER_SIZE:
        raise WireError("msgpack", f"frame says {length} bytes, carries {len(frame) - 5}")
    msg = decode_envelope(bytes(memoryview(frame)[FRAME_HEADER_SIZE:]), max_payload)
    bad = []
    # direct mode sends the bare topic, broker mode the full subject: both name the envelope's topic
    t = bytes(topic).decode("utf-8", "replace")
    if t != msg.topic and not t.endswith("." + msg.topic):
        bad.append("topic")
    if int.from_bytes(pid, "big") != msg.publisher_id:
        bad.append("publisher_id")
    if int.from_bytes(seq, "big") != msg.sequence:
        bad.append("sequence")
    msg.header_mismatch = tuple(bad)
    return msg


def _known(ev: RouterEvent) -> bool:
    data = ev.event.data
    if isinstance(data, str):
        return data == "cleared"
    return data.stored is not None or data.removed is not None or data.tier_cleared is not None


def decode_router_events(msg: DynamoMessage) -> RouterEvents:
    """The RouterEvents of a `kv-events` message (array, single map, or JSON)."""
    payload = msg.payload
    if msg.encoding == "json":
        ev = decode(_dec_event_json, payload, "RouterEvent (JSON)")
        ok = _known(ev)
        return RouterEvents([ev] if ok else [], [payload] if ok else [], True, 0, int(not ok))
    first = payload[0] if payload else -1
    if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):
        raws: list[Raw] = decode(_dec_raws, payload, "RouterEvent list")
        single = False
    elif _map_len(payload) >= 0:
        raws, single = [Raw(payload)], True
    else:
        raise WireError(
            "schema", f"kv-events payload is neither an array nor a map (0x{first:02x})"
        )
    out = RouterEvents([], [], single)
    events, kept, dec = out.events, out.raws, _dec_event.decode
    unknown_keys = unknown_variants = 0
    try:
        for raw in raws:
            rb = bytes(raw)
            ev = dec(rb)
            b = rb[0]
            # entries in the map header minus the known keys it carried (UNSET = absent)
            n = b & 0x0F if 0x80 <= b <= 0x8F else _map_len(rb)
            if n > 2:
                n -= 2 + (ev.storage_tier is not UNSET) + (ev.residency_domain is not UNSET)
                n -= (ev.state_source is not UNSET) + (ev.session_id is not UNSET)
                unknown_keys += n if n > 0 else 0
            data = ev.event.data
            if isinstance(data, str):
                ok = data == "cleared"
            else:
                ok = not (
                    data.stored is None and data.removed is None and data.tier_cleared is None
                )
            if ok:
                events.append(ev)
                kept.append(rb)
            else:
                unknown_variants += 1
    except msgspec.ValidationError as exc:
        raise WireError("schema", f"RouterEvent: {exc}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise WireError("msgpack", f"RouterEvent: {exc}") from None
    except RecursionError:
        raise WireError("msgpack", "RouterEvent: nesting too deep") from None
    out.unknown_keys, out.unknown_variants = unknown_keys, unknown_variants
    return out


def decode_active_load(msg: DynamoMessage | bytes) -> ActiveLoad:
    """ActiveLoad of a `kv_metrics` message (or its payload bytes)."""
    payload = msg.payload if isinstance(msg, DynamoMessage) else msg
    return decode(_dec_load, payload, "ActiveLoad")


def decode_fpm(msg: DynamoMessage | bytes) -> ForwardPassMetrics:
    """ForwardPassMetrics of a `forward-pass-metrics` message (relayed unchanged by Dynamo)."""
    payload = msg.payload if isinstance(msg, DynamoMessage) else msg
    return decode_forward_pass_metrics(payload)


# --- mapping into kvobserve's stream model ---------------------------------------------------


def medium_of(tier: str) -> str:
    """kvobserve medium of a Dynamo StorageTier; an unknown tier name is kept as it is."""
    return TIER_MEDIUM.get(tier, tier)


def to_kv_event(ev: RouterEvent, block_size: int) -> KvEvent:
    """The kvobserve event of one (known-variant) RouterEvent."""
    data = ev.event.data
    if isinstance(data, str):
        return AllBlocksCleared()
    medium = medium_of(ev.tier)
    if data.stored is not None:
        s = data.stored
        hashes: list[int | bytes] = [b.block_hash for b in s.blocks]
        return DynamoStored(hashes, s.parent_hash, _NO_TOKENS, block_size, None, medium)
    if data.removed is not None:
        return BlockRemoved(list(data.removed.block_hashes), medium)
    assert data.tier_cleared is not None
    return TierCleared(medium_of(data.tier_cleared))


def to_batches(
    events: RouterEvents, ts: float, block_size: int = 0, topic: str = "kv-events"
) -> list[tuple[StreamKey, KvBatch, bytes]]:
    """One KvBatch per RouterEvent, keyed by (worker_id, dp_rank), with seq = event_id - 1.

    Dynamo numbers events per (worker_id, dp_rank) from 1, so a fresh publisher starts at seq 0
    and StreamSequencer counts gaps, restarts and duplicates on Dynamo's own counter. Adjacent
    events of one stream with the same event_id (pre-2026 relays gave a whole engine batch the
    engine seq) become one batch. `ts` (seconds) is the envelope's published_at; `block_size` is
    the configured KV block size (Dynamo publishes full blocks only), 0 when unknown.
    """
    out: list[tuple[StreamKey, KvBatch, bytes]] = []
    last: tuple[int, int, int] | None = None
    for ev, raw in zip(events.events, events.raws, strict=True):
        ce = ev.event
        ident = (ev.worker_id, ce.dp_rank, ce.event_id)
        kv = to_kv_event(ev, block_size)
        if ident == last:
            key, batch, prev = out[-1]
            batch.events.append(kv)
            out[-1] = (key, batch, prev + raw)
            continue
        last = ident
        batch = KvBatch(topic, ce.event_id - 1, ts, ce.dp_rank, [kv])
        out.append(((ev.worker_id, ce.dp_rank), batch, raw))
    return out
