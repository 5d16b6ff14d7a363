"""Encode NVIDIA Dynamo event-plane messages: the simulator's second, independent encoder.

Written from the documented structs (docs/wire.md "Dynamo") and checked byte for byte against
the captures of ai-dynamo-runtime 1.6.1, 1.2.1 and 0.7.1 (tests/fixtures/dynamo-captures), not
derived from kvobserve's decoder. Maps are built in Dynamo's field order (serde declaration
order, as rmp-serde `to_vec_named` writes them); msgpack integers take their shortest form and
floats are float64, which is what both rmp and msgspec write. Pure functions, no I/O.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

KV_EVENTS = "kv-events"
KV_METRICS = "kv_metrics"
FORWARD_PASS_METRICS = "forward-pass-metrics"
CLEARED = "cleared"  # the unit variant is a bare string
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_enc = msgspec.msgpack.Encoder()
_enc_json = msgspec.json.Encoder()


def segment(name: str) -> str:
    """One subject segment: UTF-8 bytes outside [A-Za-z0-9_-] as %XX (uppercase)."""
    return "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in name.encode())


def subject(namespace: str, component: str | None, endpoint: str | None, topic: str) -> str:
    """Endpoint scope (1.6.x), component scope (endpoint None) or namespace scope (both None)."""
    parts = ["namespace", segment(namespace)]
    if component is not None:
        parts += ["component", segment(component)]
        if endpoint is not None:
            parts += ["endpoint", segment(endpoint)]
    return ".".join([*parts, segment(topic)])


def stream_subject(namespace: str, component: str, topic: str = KV_EVENTS) -> str:
    """JetStream-era subject (<= 1.2.x without the event plane); topic "queue" on 0.7.x."""
    return f"namespace-{namespace}-component-{component}-kv-events.{topic}"


def block(
    block_hash: int, tokens_hash: int, mm_extra_info: Any = None, *, legacy: bool = False
) -> dict[str, Any]:
    """KvCacheStoredBlockData; `legacy` (0.7.x) has no mm_extra_info."""
    if legacy:
        return {"block_hash": block_hash, "tokens_hash": tokens_hash}
    return {"block_hash": block_hash, "tokens_hash": tokens_hash, "mm_extra_info": mm_extra_info}


def stored(
    blocks: list[dict[str, Any]],
    parent_hash: int | None = None,
    start_position: int | None = None,
    *,
    legacy: bool = False,
) -> dict[str, Any]:
    """The `stored` variant; `legacy` (0.7.x) has no start_position."""
    if legacy:
        return {"stored": {"parent_hash": parent_hash, "blocks": blocks}}
    data = {"parent_hash": parent_hash, "start_position": start_position, "blocks": blocks}
    return {"stored": data}


def removed(block_hashes: list[int]) -> dict[str, Any]:
    """The `removed` variant."""
    return {"removed": {"block_hashes": block_hashes}}


def tier_cleared(tier: str) -> dict[str, Any]:
    """Main's TierCleared(StorageTier): a newtype variant holding a unit enum (a string)."""
    return {"tier_cleared": tier}


def router_event(
    worker_id: int,
    event_id: int,
    data: Any,
    dp_rank: int = 0,
    *,
    storage_tier: str | None = "device",
    residency_domain: str | None = "worker",
    state_source: Any = None,
    session_id: str | None = None,
) -> dict[str, Any]:
    """RouterEvent; a None storage_tier/residency_domain is left out (0.7.x / 1.2.x wire)."""
    ev: dict[str, Any] = {"worker_id": worker_id}
    if storage_tier is not None:
        ev["storage_tier"] = storage_tier
    if residency_domain is not None:
        ev["residency_domain"] = residency_domain
    ev["event"] = {"event_id": event_id, "data": data, "dp_rank": dp_rank}
    if state_source is not None:
        ev["state_source"] = state_source
    if session_id is not None:
        ev["session_id"] = session_id
    return ev


def kv_events_payload(events: list[dict[str, Any]], single: bool = False) -> bytes:
    """`Vec<RouterEvent>` (1.6.x), or one RouterEvent map (`single`, 1.2.x)."""
    if single:
        if len(events) != 1:
            raise ValueError(f"single=True needs exactly one event, got {len(events)}")
        return _enc.encode(events[0])
    return _enc.encode(events)


def router_event_json(event: dict[str, Any]) -> bytes:
    """One RouterEvent as the pre-event-plane publishers sent it (serde_json, compact)."""
    return _enc_json.encode(event)


def envelope(
    topic: str,
    publisher_id: int,
    sequence: int,
    published_at_ms: int,
    payload: bytes,
    published_at_ns: int | None = None,
) -> bytes:
    """EventEnvelope in its wire order; `published_at_ns` (main only) goes last (assumed)."""
    env: dict[str, Any] = {
        "publisher_id": publisher_id,
        "sequence": sequence,
        "published_at": published_at_ms,
        "topic": topic,
        "payload": payload,
    }
    if published_at_ns is not None:
        env["published_at_ns"] = published_at_ns
    return _enc.encode(env)


def zmq_frames(topic: str, publisher_id: int, sequence: int, envelope_bytes: bytes) -> list[bytes]:
    """ZMQ direct multipart: topic, publisher_id and sequence (u64 BE), 0x01 + u32 BE len + envelope."""
    head = struct.pack(">BI", 1, len(envelope_bytes))
    return [
        topic.encode(),
        struct.pack(">Q", publisher_id),
        struct.pack(">Q", sequence),
        head + envelope_bytes,
    ]


def active_load(
    worker_id: int,
    dp_rank: int = 0,
    active_decode_blocks: int | None = None,
    active_prefill_tokens: int | None = None,
    kv_used_blocks: int | None = None,
    waiting_requests: int | None = None,
    *,
    with_waiting: bool = False,
) -> bytes:
    """ActiveLoad; `waiting_requests` exists on main only (`with_waiting`)."""
    load: dict[str, Any] = {
        "worker_id": worker_id,
        "dp_rank": dp_rank,
        "active_decode_blocks": active_decode_blocks,
        "active_prefill_tokens": active_prefill_tokens,
        "kv_used_blocks": kv_used_blocks,
    }
    if with_waiting or waiting_requests is not None:
        load["waiting_requests"] = waiting_requests
    return _enc.encode(load)


def forward_pass_metrics(
    worker_id: str,
    dp_rank: int,
    counter_id: int,
    wall_time: float,
    scheduled: tuple[int, int, float, int, int, int, float] = (0, 0, 0.0, 0, 0, 0, 0.0),
    queued: tuple[int, int, float, int, int, float] = (0, 0, 0.0, 0, 0, 0.0),
) -> bytes:
    """ForwardPassMetrics map (version 1); all-zero counts with wall_time 0.0 is the heartbeat."""
    s_keys: tuple[str, ...] = ("num_prefill_requests", "sum_prefill_tokens", "var_prefill_length")
    s_keys += ("sum_prefill_kv_tokens", "num_decode_requests", "sum_decode_kv_tokens")
    q_keys = tuple(k for k in s_keys if k != "sum_prefill_kv_tokens")
    return _enc.encode(
        {
            "version": 1,
            "worker_id": worker_id,
            "dp_rank": dp_rank,
            "counter_id": counter_id,
            "wall_time": float(wall_time),
            "scheduled_requests": dict(
                zip((*s_keys, "var_decode_kv_tokens"), scheduled, strict=True)
            ),
            "queued_requests": dict(zip((*q_keys, "var_decode_kv_tokens"), queued, strict=True)),
        }
    )
