"""Where would a request hit: the question the aggregator asks every collector, and the answers.

The question is a request's block hashes in order (as the engine puts them on the wire) and the
workers of the pool; each collector answers, for every rank of those workers it watches, how many
leading blocks of the request the rank's top tier holds now (docs/cache-analytics.md "Checking
a router's decision"). Both travel as msgpack (msgspec), map-encoded like the snapshot so that
fields can be added; on NATS as request-reply on `kvobserve.v1.<cluster>.overlap`
(docs/nats.md), in one process through the local bus.

A hash as text is the form `kvobserve tap` prints (`kv_events.hash_json`): an integer as on the
wire (SGLang's are signed 64-bit, vLLM's unsigned) or 64 lowercase hex digits for a 32-byte hash.
"""

from __future__ import annotations

import re

import msgspec
from msgspec import Struct

from kvobserve.wire.errors import WireError, decode
from kvobserve.wire.kv_events import BlockHash

MAX_HASHES = 4096  # per request: a 64k-token prompt at 16 tokens a block
MAX_OVERLAP_BYTES = 4 * 1024 * 1024
_INT = re.compile(r"-?[0-9]{1,20}")
_HEX32 = re.compile(r"[0-9a-fA-F]{64}")
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1  # what msgpack carries


class HashError(ValueError):
    """A hash given as text that is no engine's block hash; the message names the value."""


def parse_hash(text: str) -> BlockHash:
    """A block hash from its text form (`kvobserve tap`'s); HashError names the value."""
    s = text.strip()
    if _HEX32.fullmatch(s):  # before the integer: 64 digits are never a 64-bit integer
        return bytes.fromhex(s)
    if _INT.fullmatch(s):
        value = int(s)
        if _INT_MIN <= value <= _INT_MAX:
            return value
        raise HashError(f"hash {text!r}: an integer outside the 64-bit range engines use")
    shown = text if len(text) <= 80 else text[:77] + "..."
    raise HashError(
        f"hash {shown!r}: expected an integer (SGLang, vLLM with int hashes) or 64 hex digits "
        "(a 32-byte hash), as `kvobserve tap` prints them"
    )


class OverlapRequest(Struct, omit_defaults=True, gc=False):
    """The question: a request's hashes in order, for the ranks of `workers` (None: all)."""

    hashes: list[BlockHash]
    workers: list[str] | None = None


class RankOverlap(Struct, array_like=True, gc=False):
    """One rank's answer: leading blocks of the request in its top tier now."""

    worker_id: str
    dp_rank: int
    leading_blocks: int
    up: bool  # false: the stream is not up, its index is not the engine's cache now
    trust: str  # analysis/trust.py: complete, replay_filled, partial (a lower bound then)


class OverlapReply(Struct, omit_defaults=True, gc=False):
    """One collector's answer for the ranks it watches."""

    collector_id: str
    node_rank: int
    ranks: list[RankOverlap] = []
    error: str = ""  # the request could not be read (the ranks are then empty)


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(OverlapRequest)
_reply_decoder = msgspec.msgpack.Decoder(OverlapReply)


def encode_overlap(msg: OverlapRequest | OverlapReply) -> bytes:
    """A request or a reply as msgpack."""
    return _encoder.encode(msg)


def decode_request(data: bytes) -> OverlapRequest:
    """msgpack -> OverlapRequest; raises WireError only (more than MAX_HASHES: schema)."""
    req: OverlapRequest = decode(_request_decoder, data, "overlap request", MAX_OVERLAP_BYTES)
    if len(req.hashes) > MAX_HASHES:
        raise WireError("schema", f"overlap request of {len(req.hashes)} hashes > {MAX_HASHES}")
    return req


def decode_reply(data: bytes) -> OverlapReply:
    """msgpack -> OverlapReply; raises WireError only."""
    reply: OverlapReply = decode(_reply_decoder, data, "overlap reply", MAX_OVERLAP_BYTES)
    return reply
