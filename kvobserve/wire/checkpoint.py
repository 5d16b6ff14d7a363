"""kvobserve's own checkpoint file of one stream: its bytes, framing and checksum (pure).

A file is a 16-byte header and a msgpack body:

    b"KVOCKPT" + format version (1 byte) | body length (u32 LE) | CRC-32 of the body (u32 LE)

The body is a `StreamCheckpoint` (array-encoded structs: no field names on disk). Each storage
tier keeps its resident blocks as columns, in the index's own order:

- hashes: int hashes as a msgpack list (9 bytes each for 64-bit values, signed or unsigned,
  fewer for small ones); byte hashes of one width concatenated (32 bytes each for vLLM's
  SHA-256 hashes); anything else (mixed types) as a msgpack list of both;
- store times: the float64 bits of each block's engine time, lossless, split in columns: the
  low 32 bits (4 bytes a block), the next 16 (2 bytes) and the top 16 once for the tier when
  every block shares them (sign, exponent and the mantissa's top 4 bits: any two times within
  the same 2^26 s, about 2.1 years, of today's Unix times do), else all 8 bytes a block;
- token counts that differ from the usual block size, as (hash, tokens) columns, and LoRA
  blocks by adapter name (only those).

So an int-hash block costs 15 bytes (9 + 4 + 2) and a 32-byte hash 38, plus, per stream, the
header, the identity, the anchor (the last batch's payload, kept whole for the byte-for-byte
check) and a few bytes per tier. Decoding refuses, with a `CheckpointRefused` whose reason a
person can read, anything truncated, corrupt, of another format version, another stream plan or
another configuration: a checkpoint is state to resume from, and state that is not certainly
this stream's is never trusted.
"""

from __future__ import annotations

import struct
import zlib
from typing import Final, Literal, get_args

import msgspec
from msgspec import Struct

FORMAT_VERSION: Final = 1
MAGIC: Final = b"KVOCKPT"
_HEADER = struct.Struct("<7sBII")  # magic, format version, body length, CRC-32 of the body
HEADER_BYTES: Final = _HEADER.size
MAX_BODY_BYTES: Final = 1 << 30  # a stream's checkpoint; a longer length field is corruption

RefusedReason = Literal[
    "not_checkpoint",  # does not start with the magic bytes
    "truncated",  # shorter than its header says
    "corrupt",  # checksum mismatch, trailing bytes, or a body that does not decode
    "format",  # another format version (an older or newer kvobserve)
    "plan",  # another stream, or the stream's plan changed (endpoint, topic, replay, engine)
    "config",  # written under another configuration (the fingerprint differs)
]
REFUSED_REASONS: Final[tuple[str, ...]] = get_args(RefusedReason)


class CheckpointRefused(ValueError):
    """A checkpoint that is not to be trusted; `reason` is one of REFUSED_REASONS."""

    __slots__ = ("reason",)

    def __init__(self, reason: RefusedReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason: RefusedReason = reason


class StreamIdentity(Struct, array_like=True, frozen=True, gc=False):
    """A stream and its plan: what the checkpoint must match to be this stream's."""

    worker_id: str
    dp_rank: int
    engine: str
    endpoint: str
    topic: str = ""
    replay_endpoint: str | None = None

    @property
    def key(self) -> tuple[str, int]:
        """(worker_id, dp_rank): the stream identity a file is named after."""
        return (self.worker_id, self.dp_rank)


class PublisherIdentity(Struct, array_like=True, frozen=True, gc=False):
    """The publisher instance as far as the wire shows it: the topic frame it sends, the dp rank
    its batches carry, and an instance id where the wire has one (Dynamo's envelope publisher
    id; ZMQ engines have none: there the anchor batch stands for the instance)."""

    topic: str = ""
    dp_rank: int | None = None
    instance: int | None = None

    def differs(self, other: PublisherIdentity) -> str:
        """What `other` (the live publisher) shows that this one did not ("": nothing); a field
        either side does not know says nothing."""
        for name in ("topic", "dp_rank", "instance"):
            a, b = getattr(self, name), getattr(other, name)
            if a not in (None, "") and b not in (None, "") and a != b:
                return f"{name} {a!r} -> {b!r}"
        return ""


class TierState(Struct, array_like=True, gc=False):
    """One storage tier's resident blocks, as columns (see the module docstring)."""

    medium: str
    count: int  # resident blocks
    hashes: list[int | bytes] = []  # int (or mixed) hashes; empty when `blob` holds them
    blob: bytes = b""  # byte hashes of `width` bytes each, concatenated
    width: int = 0
    ts_low: bytes = b""  # float64 bits 0-31 per block (LE); all 8 bytes when ts_top < 0
    ts_mid: bytes = b""  # bits 32-47 per block (LE)
    ts_top: int = -1  # bits 48-63, shared by every block; -1: not shared (ts_low holds all)
    odd_hashes: list[int | bytes] = []  # blocks whose token count is not the usual size ...
    odd_tokens: list[int] = []  # ... and their token counts
    lora: dict[str, list[int | bytes]] = {}  # LoRA adapter -> its resident blocks here


class StreamCheckpoint(Struct, array_like=True, gc=False):
    """One stream's state: what a restarted collector needs to resume it exactly."""

    identity: StreamIdentity
    config: str  # fingerprint of the settings that shape the index (sources/checkpoint_store.py)
    kvobserve: str  # the version that wrote it
    written_at: float  # wall clock
    publisher: PublisherIdentity
    last_seq: int | None  # the last applied seq (None: no batch yet)
    last_ts: float | None  # its engine time
    anchor: bytes  # the last applied batch's payload, byte for byte
    trust_state: str
    trust_reason: str
    block_size: int  # the usual tokens per block (0: none stored yet)
    tiers: list[TierState] = []


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StreamCheckpoint)


def pack_hashes(hashes: list[int | bytes]) -> tuple[list[int | bytes], bytes, int]:
    """(list, blob, width): byte hashes of one width as one blob, anything else as a list."""
    if not hashes or not isinstance(hashes[0], bytes):
        return hashes, b"", 0
    try:
        widths = set(map(len, hashes))  # type: ignore[arg-type]
    except TypeError:  # an int among byte hashes: never from one engine, but keep it
        return hashes, b"", 0
    if len(widths) != 1:
        return hashes, b"", 0
    return [], b"".join(hashes), widths.pop()  # type: ignore[arg-type]


def unpack_hashes(tier: TierState) -> list[int | bytes]:
    """The tier's hashes in order."""
    if not tier.width:
        return tier.hashes
    w, blob = tier.width, tier.blob
    return [blob[i : i + w] for i in range(0, len(blob), w)]


def pack_times(times: list[float]) -> tuple[bytes, bytes, int]:
    """(low, mid, top) columns of float64 store times (module docstring); top -1: `low` holds
    all 8 bytes of each. Byte slices only: no value is read."""
    n = len(times)
    raw = struct.pack(f"<{n}d", *times)
    b6, b7 = raw[6::8], raw[7::8]
    if n and not (b6 == b6[:1] * n and b7 == b7[:1] * n):
        return raw, b"", -1
    low, mid = bytearray(4 * n), bytearray(2 * n)
    for i in range(4):
        low[i::4] = raw[i::8]
    mid[0::2], mid[1::2] = raw[4::8], raw[5::8]
    return bytes(low), bytes(mid), (b6[0] | b7[0] << 8) if n else 0


def unpack_times(tier: TierState) -> list[float]:
    """The tier's store times, one float object per distinct time (as the index shares them)."""
    n = tier.count
    if tier.ts_top < 0:
        raw = tier.ts_low
    else:
        buf = bytearray(8 * n)
        low, mid = tier.ts_low, tier.ts_mid
        for i in range(4):
            buf[i::8] = low[i::4]
        buf[4::8], buf[5::8] = mid[0::2], mid[1::2]
        buf[6::8] = bytes([tier.ts_top & 0xFF]) * n
        buf[7::8] = bytes([tier.ts_top >> 8]) * n
        raw = bytes(buf)
    times = struct.unpack(f"<{n}d", raw)
    same: dict[float, float] = {}
    return list(map(same.setdefault, times, times))


def _check_tier(t: TierState) -> None:
    n = t.count
    hashes = len(t.blob) // t.width if t.width else len(t.hashes)
    if t.width and len(t.blob) % t.width:
        raise CheckpointRefused(
            "corrupt", f"tier {t.medium}: hash blob not a multiple of {t.width}"
        )
    want = (8 * n, 0) if t.ts_top < 0 else (4 * n, 2 * n)
    if n < 0 or hashes != n or (len(t.ts_low), len(t.ts_mid)) != want:
        raise CheckpointRefused(
            "corrupt", f"tier {t.medium}: {n} blocks, {hashes} hashes, store times do not match"
        )
    if len(t.odd_hashes) != len(t.odd_tokens) or t.ts_top > 0xFFFF:
        raise CheckpointRefused("corrupt", f"tier {t.medium}: odd token columns do not match")


def encode_checkpoint(ck: StreamCheckpoint) -> bytes:
    """The file's bytes: header and body."""
    body = _encoder.encode(ck)
    return _HEADER.pack(MAGIC, FORMAT_VERSION, len(body), zlib.crc32(body)) + body


def _plan_differs(had: StreamIdentity, want: StreamIdentity) -> str:
    for name in StreamIdentity.__struct_fields__:
        a, b = getattr(had, name), getattr(want, name)
        if a != b:
            return f"{name} {a!r}, the plan has {b!r}"
    return ""


def decode_checkpoint(
    data: bytes, identity: StreamIdentity | None = None, config: str | None = None
) -> StreamCheckpoint:
    """The checkpoint in `data`, if it is whole and (when given) of `identity` under `config`;
    else CheckpointRefused with the reason."""
    if len(data) < HEADER_BYTES:
        if not MAGIC.startswith(data[: len(MAGIC)]):
            raise CheckpointRefused("not_checkpoint", f"starts with {data[:8]!r}")
        raise CheckpointRefused(
            "truncated", f"{len(data)} bytes, the header alone is {HEADER_BYTES}"
        )
    magic, version, length, crc = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CheckpointRefused("not_checkpoint", f"starts with {data[:8]!r}")
    if version != FORMAT_VERSION:
        raise CheckpointRefused(
            "format", f"format version {version}; this kvobserve reads version {FORMAT_VERSION}"
        )
    have = len(data) - HEADER_BYTES
    if length > MAX_BODY_BYTES:
        raise CheckpointRefused("corrupt", f"body length {length} in the header")
    if have < length:
        raise CheckpointRefused("truncated", f"{have} of {length} body bytes")
    if have > length:
        raise CheckpointRefused("corrupt", f"{have - length} bytes after the body")
    body = memoryview(data)[HEADER_BYTES:]
    if zlib.crc32(body) != crc:
        raise CheckpointRefused("corrupt", "checksum mismatch")
    try:
        ck = _decoder.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointRefused("corrupt", f"body: {exc}") from None
    for t in ck.tiers:
        _check_tier(t)
    if identity is not None:
        why = _plan_differs(ck.identity, identity)
        if why:
            raise CheckpointRefused("plan", f"of {ck.identity.worker_id} rank "
                                    f"{ck.identity.dp_rank} with {why}")  # fmt: skip
    if config is not None and ck.config != config:
        raise CheckpointRefused(
            "config", f"written under configuration {ck.config}, this one is {config}"
        )
    return ck
